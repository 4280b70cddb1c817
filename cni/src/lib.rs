//! ferry's CNI plugin: one veth pair per pod, point-to-point routes with the node as
//! gateway (no bridge), addresses from the node's pod CIDRs kept in a crash-safe store.
//!
//! It speaks CNI 1.0.0 and 1.1.0: `ADD`, `DEL`, `CHECK`, `VERSION`, `STATUS` and `GC`.
//!
//! # Configuration (one plugin object of a conflist, as the runtime passes it on stdin)
//!
//! | field | meaning |
//! |---|---|
//! | `cniVersion`, `name`, `type` | as the specification says; `name` names the store directory |
//! | `podCIDRs` (alias `ranges`) | the node's pod CIDRs: one IPv4, one IPv6 or one of each (dual-stack gives a pod one address per family) |
//! | `mtu` | MTU of the node's network, default 1500 |
//! | `overlayOverhead` | bytes an overlay adds (VXLAN: 50), subtracted from `mtu` for both veth ends; default 0 |
//! | `dataDir` | the IPAM store's parent directory, default `/var/lib/ferry/cni` |
//! | `prevResult` | CHECK compares it with what it finds; DEL ignores it |
//! | `cni.dev/valid-attachments` | GC keeps these attachments and frees every other |
//!
//! Unknown fields are ignored. The addressing is described in [`plan`], the store in
//! [`store`], the error codes in [`error`].

pub mod commands;
pub mod config;
pub mod error;
pub mod ipam;
pub mod netlink;
pub mod plan;
pub mod result;
pub mod store;

use serde_json::Value;

use crate::{
    config::{Command, DEFAULT_VERSION, Env, NetConf, SUPPORTED_VERSIONS},
    error::Error,
};

/// Runs one invocation: `var` reads the environment, `stdin` is the configuration.
/// Returns the exit code and what goes to stdout (a result, an error result, or nothing).
pub fn run(var: impl Fn(&str) -> Option<String>, stdin: &str) -> (i32, Option<String>) {
    let input: Option<Value> = serde_json::from_str(stdin).ok();
    // Errors are reported in the input's version when this plugin speaks it.
    let version = input
        .as_ref()
        .and_then(|v| v.get("cniVersion"))
        .and_then(Value::as_str)
        .filter(|v| SUPPORTED_VERSIONS.contains(v))
        .unwrap_or(DEFAULT_VERSION)
        .to_string();
    match dispatch(var, stdin, input) {
        Ok(out) => (0, out.map(|v| v.to_string())),
        Err(e) => {
            eprintln!("ferry-cni: {e}");
            (1, Some(result::error_result(&version, &e).to_string()))
        }
    }
}

fn dispatch(
    var: impl Fn(&str) -> Option<String>,
    stdin: &str,
    input: Option<Value>,
) -> Result<Option<Value>, Error> {
    let env = Env::from_vars(var)?;
    let input = input.ok_or_else(|| {
        let e = serde_json::from_str::<Value>(stdin).err();
        Error::new(
            error::DECODE_FAILURE,
            "cannot decode the network configuration",
            format!(
                "stdin is not JSON: {}",
                e.map(|e| e.to_string()).unwrap_or_default()
            ),
        )
    })?;
    if env.command == Command::Version {
        let v = input
            .get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_VERSION);
        return Ok(Some(result::version_result(v)));
    }
    let conf = NetConf::parse(&input)?;
    match env.command {
        Command::Add => commands::add(&env, &conf).map(Some),
        Command::Del => commands::del(&env, &conf).map(|()| None),
        Command::Check => commands::check(&env, &conf).map(|()| None),
        Command::Status => commands::status(&conf).map(|()| None),
        Command::Gc => commands::gc(&conf).map(|()| None),
        Command::Version => unreachable!("answered above"),
    }
}
