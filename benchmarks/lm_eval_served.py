"""lm-eval's own CLI (`lm_eval --model local-completions`) runs a multiple-choice task and a
loglikelihood_rolling task against `flashlane serve` (engine process, prefix cache on), and every
per-item log-likelihood it logs equals the same tokens scored offline through `LLM.score` (fp32).

The tasks are local (no hub): multiple-choice questions about Python written here, and for the
rolling task paragraphs of Python's own documentation (`pydoc_data.topics`).

    python benchmarks/lm_eval_served.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

from common import Timer, served, write_result

QUESTIONS = [
    ("Which keyword defines a function in Python?", ["def", "func", "lambda x", "define"], 0),
    ("Which built-in returns the number of items in a list?", ["len", "count", "size", "items"], 0),
    ("What does `import` do?", ["loads a module", "deletes a file", "prints text", "starts a thread"], 0),
    ("Which type is immutable?", ["tuple", "list", "dict", "set"], 0),
    ("Which statement leaves a loop early?", ["break", "pass", "return 0", "goto"], 0),
    ("What does `None` mean?", ["no value", "zero", "an empty string", "false and true"], 0),
]


def write_tasks(folder: Path, paragraphs: int) -> None:
    import pydoc_data.topics as topics

    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    texts = [topics.topics[k].strip()[:1200] for k in sorted(topics.topics)[:paragraphs]]
    (folder / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "flashlane_mc.yaml").write_text(textwrap.dedent(f"""\
        task: flashlane_mc
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {folder / 'mc.jsonl'}}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        target_delimiter: " "
        metric_list:
          - metric: acc
        """))
    (folder / "flashlane_rolling.yaml").write_text(textwrap.dedent(f"""\
        task: flashlane_rolling
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {folder / 'rolling.jsonl'}}}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        """))


def offline_scores(model: str, samples: list[tuple[str, dict]], max_length: int) -> list[tuple[float, float]]:
    """(served, offline) log-likelihood per logged request, offline by LLM.score of the same ids."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from flashlane import LLM

    llm = LLM(model, dtype="float32", enable_prefix_caching=False)
    tokenizer = llm.tokenizer
    # lm-eval's windows: its max_length less one kept for generation, less one for the context,
    # after its prefix token (the tokenizer's BOS, else EOS)
    prefix = tokenizer.bos_token_id or tokenizer.eos_token_id
    pairs = []
    for task, s in samples:
        for args, resp in zip(s["arguments"].values(), s["resps"]):   # {"gen_args_i": {"arg_0", ...}}
            served_ll = resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]
            if task == "flashlane_mc":
                context, continuation = args["arg_0"], args["arg_1"]
                ctx = tokenizer.encode(context, add_special_tokens=False)
                whole = tokenizer.encode(context + continuation, add_special_tokens=False)
                cont = whole[len(ctx):]
                rows = llm.score([ctx + cont])[0][len(ctx) - 1:]
                offline = sum(rows[i, t].item() for i, t in enumerate(cont))
            else:
                ids = tokenizer.encode(args["arg_0"], add_special_tokens=False)
                offline = 0.0
                for window in map(make_disjoint_window, get_rolling_token_windows(
                        ids, prefix_token=prefix, max_seq_len=max_length - 2, context_len=1)):
                    ctx, cont = window
                    rows = llm.score([ctx + cont])[0][len(ctx) - 1:]
                    offline += sum(rows[i, t].item() for i, t in enumerate(cont))
            pairs.append((float(served_ll), offline))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8393)
    ap.add_argument("--paragraphs", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--work-dir", default=None, help="keep the task files and lm-eval's output here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.work_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        write_tasks(folder, args.paragraphs)
        url = f"http://127.0.0.1:{args.port}"
        model_args = (f"model={args.model},base_url={url}/v1/completions,tokenizer_backend=auto,"
                      f"tokenized_requests=True,num_concurrent=1,max_retries=1,max_length={args.max_length}")
        cmd = ["lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", "flashlane_mc,flashlane_rolling", "--include_path", str(folder),
               "--output_path", str(folder / "out"), "--log_samples", "--batch_size", "2"]
        with served(args.model, args.port, ["--enable-prefix-caching"]), Timer() as t:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results = json.loads(next((folder / "out").rglob("results_*.json")).read_text())
        samples = [(task, json.loads(line)) for task in ("flashlane_mc", "flashlane_rolling")
                   for f in (folder / "out").rglob(f"samples_{task}_*.jsonl")
                   for line in f.read_text().splitlines() if line]
    pairs = offline_scores(args.model, samples, args.max_length)
    worst = max(abs(a - b) for a, b in pairs)
    write_result(f"lm_eval_served_{args.model}", {
        "model": args.model, "lm_eval_seconds": round(t.seconds, 1), "load_average": os.getloadavg(),
        "results": results["results"], "items": {t: sum(1 for task, _ in samples if task == t)
                                                 for t in ("flashlane_mc", "flashlane_rolling")},
        "requests_compared": len(pairs), "max_abs_diff_vs_llm_score": worst,
        "goal": "0 errors; every logged log-likelihood equals LLM.score within 1e-4",
        "met": worst <= 1e-4,
    }, args.out)


if __name__ == "__main__":
    main()
