# The commands people type. `just --list` shows them.

# Run the CPU test suite (what CI runs).
test:
    cargo nextest run --workspace

# Regenerate every golden fixture from the tiny models (Python venv under target/).
golden *ARGS:
    cargo xtask golden {{ARGS}}

# Build the folder that runs the GPU tests on a machine without Rust.
gpu-bundle *ARGS:
    cargo xtask gpu-bundle {{ARGS}}

# Benchmarks on the GPU (through the bundle).
bench *ARGS:
    cargo xtask bench {{ARGS}}

# One prompt on the embedded default model.
generate PROMPT="And God said":
    cargo run --release -- --prompt "{{PROMPT}}"
