"""Structured compression of loaded models: expert and channel pruning, knowledge distillation.

Calibration runs the flashlane model itself (plain torch, forward hooks, the real router); the
results are written as Hugging Face checkpoint folders that flashlane and transformers both load.
"""
