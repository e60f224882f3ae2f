//! bpf-linker must be on PATH: say so plainly instead of failing deep in the link step.
fn main() {
    println!("cargo:rerun-if-env-changed=PATH");
    if which::which("bpf-linker").is_err() {
        println!("cargo:warning=bpf-linker not found on PATH: run ./deploy/setup.sh");
    }
}
