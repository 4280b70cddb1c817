//! Embeds the eBPF objects built by `cargo xtask build-ebpf` (Service routing's
//! `ferry.bpf.o` and the pod network's `ferry-podnet.bpf.o`) when they exist; otherwise
//! empty stubs, so `cargo check`, clippy and unit tests never need the BPF toolchain. The
//! agent refuses to start on a stub with a message that says how to build the object.
//! `FERRY_BPF_DIR` takes the objects from another directory (a build of another checkout).

use std::{env, fs, path::PathBuf};

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("..");
    println!("cargo:rerun-if-env-changed=FERRY_BPF_DIR");
    let dir = env::var_os("FERRY_BPF_DIR").map_or_else(|| root.join("target/bpf"), PathBuf::from);
    for name in ["ferry.bpf.o", "ferry-podnet.bpf.o"] {
        let object = dir.join(name);
        let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join(name);
        println!("cargo:rerun-if-changed={}", object.display());
        match fs::read(&object) {
            Ok(bytes) => fs::write(&out, bytes).expect("write the object to OUT_DIR"),
            Err(_) => {
                println!(
                    "cargo:warning=eBPF object {} not found: building an agent that cannot load it; run `cargo xtask build`",
                    object.display()
                );
                fs::write(&out, []).expect("write the stub to OUT_DIR");
            }
        }
    }
}
