//! Takeover from kube-proxy: removes the rules a kube-proxy left behind on this node, and
//! only kube-proxy's, once ferry serves the Services itself.
//!
//! - iptables, both backends (`iptables-legacy`, `iptables-nft`, and their `ip6tables`
//!   twins, whichever exist): from each table's `*-save` dump, the chains kube-proxy owns
//!   (its iptables and ipvs modes; see [`plan::is_kube_proxy_chain`]) are flushed and
//!   deleted, and every rule elsewhere that jumps to one of them is deleted, in one
//!   `*-restore --noflush` per table (atomic per table). Everything else stays: the
//!   kubelet's `KUBE-FIREWALL` and `KUBE-KUBELET-CANARY`, `KUBE-MARK-DROP` (the kubelet
//!   made it too), and every rule of other owners, in their order.
//! - nftables: the `kube-proxy` tables of families `ip` and `ip6` (kube-proxy's nftables
//!   mode keeps everything there), each deleted with one `nft delete table`.
//!
//! Established connections are untouched: conntrack keeps the NAT of a flow kube-proxy
//! set up, whatever happens to the rules. New connections are ferry's once its first sync
//! is written, which is why the agent runs this only then.
//!
//! The decisions are pure ([`plan`]); this module only runs the tools.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

pub mod plan;

/// The iptables tables kube-proxy writes.
pub const TABLES: [&str; 3] = ["nat", "filter", "mangle"];
/// The nftables families of kube-proxy's `kube-proxy` table.
pub const NFT_FAMILIES: [&str; 2] = ["ip", "ip6"];
pub const NFT_TABLE: &str = "kube-proxy";

#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// No iptables save/restore pair and no nft found: nothing could be checked.
    #[error(
        "takeover: none of iptables-legacy-save, iptables-nft-save, iptables-save, nft was found in PATH (or /usr/sbin, /sbin); install iptables or nftables"
    )]
    NoTools,
    /// Some backends failed; the others were done (see the report).
    #[error("takeover: {}", .0.join("; "))]
    Failed(Vec<String>),
}

/// One backend and table (or nftables table) and what was (or would be) removed there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    /// `iptables-legacy`, `ip6tables-nft`, `nft`, ...
    pub backend: String,
    /// `nat`, `filter`, `mangle`; for nft `ip kube-proxy`.
    pub table: String,
    /// The chains deleted.
    pub chains: Vec<String>,
    /// The rules gone with them: those in the deleted chains, plus the jumps to them.
    pub rules: usize,
    /// Of `rules`, the jumps from built-in chains.
    pub jumps: usize,
    /// kube-proxy's chains left whole because another owner's chain jumps to them.
    pub kept: Vec<String>,
}

/// What a takeover did (or, with `dry_run`, would do).
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub dry_run: bool,
    /// The backends looked at (`iptables-legacy`, `ip6tables-nft`, `nft`...).
    pub checked: Vec<String>,
    pub removed: Vec<Removed>,
    /// Backends or tables that failed (the others were done).
    pub errors: Vec<String>,
}

impl Report {
    /// True when nothing of kube-proxy's was (or would be) removed.
    pub fn is_empty(&self) -> bool {
        self.removed
            .iter()
            .all(|r| r.chains.is_empty() && r.rules == 0)
    }

    /// One line per backend and table, for people and logs.
    pub fn summary(&self) -> String {
        let verb = if self.dry_run {
            "would remove"
        } else {
            "removed"
        };
        let mut out = String::new();
        if self.is_empty() {
            out.push_str(&format!(
                "no kube-proxy rules found (checked {})\n",
                self.checked.join(", ")
            ));
        }
        for r in &self.removed {
            let (chains, rules) = (r.chains.len(), r.rules);
            if r.backend == "nft" {
                out.push_str(&format!(
                    "{} {}: {verb} the table ({chains} chains, {rules} rules)",
                    r.backend, r.table
                ));
            } else {
                out.push_str(&format!(
                    "{} {}: {verb} {chains} chains and {rules} rules ({} of them jumps from built-in chains)",
                    r.backend, r.table, r.jumps
                ));
            }
            if self.dry_run && !r.chains.is_empty() {
                out.push_str(&format!(": {}", r.chains.join(" ")));
            }
            if !r.kept.is_empty() {
                out.push_str(&format!(
                    "; kept {} (another chain jumps to them)",
                    r.kept.join(" ")
                ));
            }
            out.push('\n');
        }
        for e in &self.errors {
            out.push_str(&format!("error: {e}\n"));
        }
        out
    }

    pub fn chains_removed(&self) -> usize {
        self.removed.iter().map(|r| r.chains.len()).sum()
    }

    pub fn rules_removed(&self) -> usize {
        self.removed.iter().map(|r| r.rules).sum()
    }
}

/// An iptables save/restore pair of one backend and family.
struct IptablesTool {
    label: String,
    save: PathBuf,
    restore: PathBuf,
}

/// Where the tools are looked for: `PATH`, then the usual sbin directories (an agent's
/// environment may lack them).
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The iptables backends present: `iptables-legacy-*` and `iptables-nft-*` for each
/// family; when neither exists, the plain `iptables-save`/`iptables-restore` (named after
/// the backend its `--version` reports).
fn iptables_tools() -> Vec<IptablesTool> {
    let mut tools = Vec::new();
    for family in ["iptables", "ip6tables"] {
        let mut found = false;
        for backend in ["legacy", "nft"] {
            let (save, restore) = (
                find_tool(&format!("{family}-{backend}-save")),
                find_tool(&format!("{family}-{backend}-restore")),
            );
            if let (Some(save), Some(restore)) = (save, restore) {
                tools.push(IptablesTool {
                    label: format!("{family}-{backend}"),
                    save,
                    restore,
                });
                found = true;
            }
        }
        if found {
            continue;
        }
        if let (Some(save), Some(restore)) = (
            find_tool(&format!("{family}-save")),
            find_tool(&format!("{family}-restore")),
        ) {
            let version = Command::new(&save)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            let backend = if version.contains("nf_tables") {
                "nft"
            } else {
                "legacy"
            };
            tools.push(IptablesTool {
                label: format!("{family}-{backend}"),
                save,
                restore,
            });
        }
    }
    tools
}

/// Runs `cmd`, feeding `input` on stdin; stdout on success, else an error that names the
/// command and carries its stderr.
fn run_tool(cmd: &mut Command, input: Option<&str>) -> Result<String, String> {
    let shown = format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", shown.trim()))?;
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| format!("{}: writing its input: {e}", shown.trim()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{}: {e}", shown.trim()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed ({}): {}",
            shown.trim(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One iptables backend and family: dumps every table that exists (a dump of all tables
/// never creates one, as `-t TABLE` would in the legacy backend), then one restore per
/// table that holds anything of kube-proxy's.
fn takeover_iptables(tool: &IptablesTool, dry_run: bool, report: &mut Report) {
    let dump = match run_tool(&mut Command::new(&tool.save), None) {
        Ok(d) => d,
        Err(e) => return report.errors.push(format!("{}: {e}", tool.label)),
    };
    for table in plan::parse_save(&dump) {
        if !TABLES.contains(&table.name.as_str()) {
            continue;
        }
        let p = plan::plan_table(&table);
        if p.is_empty() {
            if !p.kept.is_empty() {
                report.removed.push(Removed {
                    backend: tool.label.clone(),
                    table: table.name.clone(),
                    chains: Vec::new(),
                    rules: 0,
                    jumps: 0,
                    kept: p.kept.clone(),
                });
            }
            continue;
        }
        if !dry_run {
            let mut cmd = Command::new(&tool.restore);
            cmd.args(["--noflush", "--wait=10"]);
            if let Err(e) = run_tool(&mut cmd, Some(&p.restore_input())) {
                report
                    .errors
                    .push(format!("{} table {}: {e}", tool.label, table.name));
                continue;
            }
        }
        report.removed.push(Removed {
            backend: tool.label.clone(),
            table: table.name.clone(),
            chains: p.chains.clone(),
            rules: p.rules_removed(),
            jumps: p.jumps.len(),
            kept: p.kept.clone(),
        });
    }
}

/// kube-proxy's nftables tables (`ip kube-proxy`, `ip6 kube-proxy`), each deleted whole.
fn takeover_nft(nft: &Path, dry_run: bool, report: &mut Report) {
    let tables = match run_tool(Command::new(nft).args(["list", "tables"]), None) {
        Ok(t) => plan::parse_nft_tables(&t),
        Err(e) => return report.errors.push(format!("nft: {e}")),
    };
    for family in NFT_FAMILIES {
        if !tables.iter().any(|(f, n)| f == family && n == NFT_TABLE) {
            continue;
        }
        let listing = run_tool(
            Command::new(nft).args(["list", "table", family, NFT_TABLE]),
            None,
        )
        .unwrap_or_default();
        let (chains, rules) = plan::nft_chains_and_rules(&listing);
        if !dry_run
            && let Err(e) = run_tool(
                Command::new(nft).args(["delete", "table", family, NFT_TABLE]),
                None,
            )
        {
            report.errors.push(format!("nft {family} {NFT_TABLE}: {e}"));
            continue;
        }
        report.removed.push(Removed {
            backend: "nft".into(),
            table: format!("{family} {NFT_TABLE}"),
            chains,
            rules,
            jumps: 0,
            kept: Vec::new(),
        });
    }
}

/// Removes kube-proxy's rules from every backend found (or, with `dry_run`, reports what
/// it would remove). A backend that fails does not stop the others; the error lists them.
/// Blocking: runs the iptables and nft tools.
pub fn run(dry_run: bool) -> Result<Report, (Report, TakeoverError)> {
    let mut report = Report {
        dry_run,
        ..Default::default()
    };
    let tools = iptables_tools();
    let nft = find_tool("nft");
    if tools.is_empty() && nft.is_none() {
        return Err((report, TakeoverError::NoTools));
    }
    for tool in &tools {
        report.checked.push(tool.label.clone());
        takeover_iptables(tool, dry_run, &mut report);
    }
    if let Some(nft) = &nft {
        report.checked.push("nft".into());
        takeover_nft(nft, dry_run, &mut report);
    }
    if report.errors.is_empty() {
        Ok(report)
    } else {
        let errors = report.errors.clone();
        Err((report, TakeoverError::Failed(errors)))
    }
}
