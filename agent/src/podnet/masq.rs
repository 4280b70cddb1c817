//! The masquerade of pod traffic leaving the cluster: one nftables table per family
//! (`ip ferry-podnet`, `ip6 ferry-podnet`), replaced whole in one `nft -f -` transaction
//! (see [`super::plan::masquerade_script`]).

use std::{
    io::Write,
    process::{Command, Stdio},
};

/// Runs `nft -f -` with `script`. Blocking.
pub fn apply(script: &str) -> Result<(), String> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running nft (package nftables; the image has it): {e}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .map_err(|e| format!("nft -f -: writing the rules: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("nft -f -: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft -f - failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
