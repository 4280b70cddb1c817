//! Embeds the eBPF object built by `cargo xtask build-ebpf` when it exists; otherwise an
//! empty stub, so `cargo check`, clippy and unit tests never need the BPF toolchain. The
//! agent refuses to start on the stub with a message that says how to build the object.

use std::{env, fs, path::PathBuf};

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("..");
    let object = root.join("target/bpf/ferry.bpf.o");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ferry.bpf.o");
    println!("cargo:rerun-if-changed={}", object.display());
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write OUT_DIR/ferry.bpf.o"),
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found: building an agent that cannot load programs; run `cargo xtask build`",
                object.display()
            );
            fs::write(&out, []).expect("write OUT_DIR/ferry.bpf.o");
        }
    }
}
