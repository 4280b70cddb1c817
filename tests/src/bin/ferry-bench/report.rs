//! The shared parts of the reports: the header that states the machine and the mode,
//! and the generated sections of docs/benchmarks.md (between marker comments).

use std::{fs, path::Path};

use serde_json::Value;

/// "Machine: ..., mode, revision" for the top of a generated section.
pub(crate) fn header(doc: &Value) -> String {
    let m = &doc["machine"];
    format!(
        "Measured by `cargo xtask bench {}`{} on Linux {}, {} CPUs ({}), {} MiB RAM, at commit {}{}; the run took {:.0} s.\n\n",
        doc["benchmark"].as_str().unwrap_or("?"),
        if doc["mode"] == "quick" {
            " --quick (short runs: indicative only)"
        } else {
            ""
        },
        m["kernel"].as_str().unwrap_or("?"),
        m["nproc"],
        m["cpu"].as_str().unwrap_or("?"),
        m["mem_total_kib"].as_u64().unwrap_or(0) / 1024,
        doc["revision"]["commit"].as_str().unwrap_or("?"),
        if doc["revision"]["uncommitted"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
        {
            " (with uncommitted changes in agent/common/ebpf)"
        } else {
            ""
        },
        doc["elapsed_s"].as_f64().unwrap_or(0.0),
    )
}

/// Replaces the text between `<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->`
/// in `doc` (a missing pair is appended at the end).
pub(crate) fn update_docs(doc: &Path, name: &str, body: &str) -> Result<(), String> {
    let text = fs::read_to_string(doc).map_err(|e| format!("{}: {e}", doc.display()))?;
    let (b, e) = (
        format!("<!-- bench:{name}:begin -->"),
        format!("<!-- bench:{name}:end -->"),
    );
    let section = format!("{b}\n{}\n{e}", body.trim_end());
    let new = match (text.find(&b), text.find(&e)) {
        (Some(i), Some(j)) if j > i => format!("{}{section}{}", &text[..i], &text[j + e.len()..]),
        _ => format!("{}\n{section}\n", text.trim_end()),
    };
    fs::write(doc, new).map_err(|e| format!("{}: {e}", doc.display()))
}

/// A ratio's cell: `median [min-max]` of a `util::spread`.
pub(crate) fn ratio(v: &Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    format!("{:.3} [{:.3}-{:.3}]", f("median"), f("min"), f("max"))
}

/// "Targets:" and a table of (target, met, result) rows.
pub(crate) fn targets_table(rows: &[(String, bool, String)]) -> String {
    let mut s = String::from("\nTargets:\n\n| target | result | |\n|---|---|---|\n");
    for (what, ok, val) in rows {
        s.push_str(&format!(
            "| {what} | {val} | {} |\n",
            if *ok { "met" } else { "**missed**" }
        ));
    }
    s
}
