//! `ferry-cni`: called by the container runtime with `CNI_*` variables and the network
//! configuration on stdin; see the library for what it does.

use std::io::{Read, Write};

fn main() {
    let mut stdin = String::new();
    let (code, out) = match std::io::stdin().read_to_string(&mut stdin) {
        Ok(_) => ferry_cni::run(|k| std::env::var(k).ok(), &stdin),
        Err(e) => {
            let err = ferry_cni::error::Error::new(
                ferry_cni::error::IO_FAILURE,
                "cannot read the network configuration",
                format!("reading stdin: {e}"),
            );
            let v = ferry_cni::result::error_result(ferry_cni::config::DEFAULT_VERSION, &err);
            (1, Some(v.to_string()))
        }
    };
    if let Some(out) = out {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{out}");
        let _ = o.flush();
    }
    std::process::exit(code);
}
