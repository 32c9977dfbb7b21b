//! `cargo xtask <command>`: the project's developer commands (golden, gpu-bundle, bench, synth, slice).

fn main() {
    eprintln!("xtask: being written");
    std::process::exit(1);
}
