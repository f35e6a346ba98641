"""The GPU tier: `make gpu-check` (scripts/gpu-check.sh) runs gpu_check.py on a machine with one NVIDIA GPU."""
