"""flashlane's own CPU kernels in C++, compiled on first use with the system's C++ compiler and
called through ctypes (no torch headers: a build takes about a second). Each is an optional fast
path: where it cannot be built or the CPU lacks its instructions, the caller says why and keeps
torch's kernel."""
