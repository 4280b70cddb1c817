//! `cargo xtask image`: ferry's container image as an OCI archive, without Docker, and
//! the Gardener extension controller's (its binary, libraries and CA certificates only;
//! [`CONTROLLER`]).
//!
//! The archive `target/image/ferry-<version>.oci.tar` is an OCI image layout (oci-layout,
//! index.json, blobs/sha256/...) in a plain tar, plus Docker's `manifest.json` so that
//! `docker load` and older importers read it too. It holds one gzip layer with:
//! - `/usr/local/bin/ferry` (the entrypoint) and `/usr/local/bin/ferry-cni` (the CNI
//!   plugin that `ferry agent --pod-network` installs on the node),
//! - the shared libraries `ldd` lists for it, at the paths `ldd` prints, and the dynamic
//!   loader (ferry links glibc dynamically),
//! - `/etc/ssl/certs/ca-certificates.crt` from the host (Debian `ca-certificates`),
//! - the tools `--takeover-kube-proxy` runs, from the host's Debian `iptables` and
//!   `nftables`: `xtables-legacy-multi` and `xtables-nft-multi` with the
//!   `{ip,ip6}tables-{legacy,nft}-{save,restore}` links they dispatch on, `nft`, the
//!   iptables match and target modules (`/usr/lib/<triple>/xtables/lib{xt,ipt,ip6t}_*.so`,
//!   which `iptables-restore` loads for each rule it parses) and the libraries of all of
//!   them, plus `/etc/protocols`,
//! - a one-line `/etc/passwd` (root) and an empty `/tmp` (mode 1777).
//!
//! The image is named [`IMAGE_REPO`]`:<version>` through both annotations importers read
//! (`io.containerd.image.name` for containerd, `kind load image-archive` and `ctr images
//! import`; `org.opencontainers.image.ref.name` for skopeo and podman).
//!
//! Reproducible: entries sorted by path, mtime `SOURCE_DATE_EPOCH` (0 when unset), uid
//! and gid 0, fixed modes, no user or group names, gzip with mtime 0 and a fixed OS byte.
//! Two builds of the same binary give the same layer, config and manifest digests.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::build;

/// The image's repository; the tag is the workspace version.
pub(crate) const IMAGE_REPO: &str = "ghcr.io/ferry-proj/ferry";
const VERSION: &str = env!("CARGO_PKG_VERSION");
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MT_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// One of the images `cargo xtask image` writes.
#[derive(Clone, Copy)]
pub(crate) struct Spec {
    /// The repository; the tag is the workspace version.
    pub(crate) repo: &'static str,
    /// The binary in target/release, installed as /usr/local/bin/<name>, the entrypoint.
    pub(crate) binary: &'static str,
    /// The default arguments, if any.
    pub(crate) cmd: Option<&'static str>,
}

/// The node agent (with the CNI plugin and the takeover's tools).
pub(crate) const FERRY: Spec = Spec {
    repo: IMAGE_REPO,
    binary: "ferry",
    cmd: Some("agent"),
};
/// The Gardener extension controller (crate gardener/): its binary, CA certificates and
/// libraries only.
pub(crate) const CONTROLLER: Spec = Spec {
    repo: "ghcr.io/ferry-proj/gardener-extension-ferry",
    binary: "gardener-extension-ferry",
    cmd: None,
};

impl Spec {
    /// `<repo>:<version>`, the name importers give the image.
    pub(crate) fn image_ref(&self) -> String {
        format!("{}:{VERSION}", self.repo)
    }

    /// Where `cargo xtask image` leaves the archive.
    pub(crate) fn archive_path(&self) -> PathBuf {
        build::workspace_root().join(format!("target/image/{}-{VERSION}.oci.tar", self.binary))
    }
}


/// Builds target/release/ferry (eBPF object first) unless `no_build`, then the archive.
pub(crate) fn run(no_build: bool) -> Result<()> {
    if !no_build {
        build::all()?;
    }
    build_archive()
}

/// Writes both archives from the binaries already built.
pub(crate) fn build_archive() -> Result<()> {
    write_archive(FERRY)?;
    write_archive(CONTROLLER)
}

fn write_archive(spec: Spec) -> Result<()> {
    let started = std::time::Instant::now();
    let bin = build::workspace_root()
        .join("target/release")
        .join(spec.binary);
    if !bin.exists() {
        bail!(
            "{} is missing: run `cargo xtask build` first",
            bin.display()
        );
    }
    let mtime = source_date_epoch()?;
    let entries = if spec.binary == FERRY.binary {
        image_entries(&bin)?
    } else {
        base_entries(&bin, spec.binary)?
    };
    let layer_tar = tar(&entries, mtime);
    let layer_gz = gzip(&layer_tar)?;
    let image = Image::new(spec, &layer_tar, layer_gz);
    let out = spec.archive_path();
    fs::create_dir_all(out.parent().unwrap())?;
    let tmp = out.with_extension("tar.tmp");
    fs::write(&tmp, image.archive(spec, mtime))
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &out).with_context(|| format!("renaming to {}", out.display()))?;
    println!(
        "image: {} ({}), layer {} ({:.1} MB gzip, {:.1} MB uncompressed), manifest {}, in {:.1}s",
        out.display(),
        spec.image_ref(),
        image.layer_digest,
        image.layer_gz.len() as f64 / 1e6,
        layer_tar.len() as f64 / 1e6,
        image.manifest_digest,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn source_date_epoch() -> Result<u64> {
    match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(s) if !s.is_empty() => s
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={s:?} is not a number of seconds")),
        _ => Ok(0),
    }
}

/// One entry of the layer: a path without the leading `/` and what is there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Node {
    Dir {
        mode: u32,
    },
    File {
        mode: u32,
        data: Vec<u8>,
    },
    /// A symbolic link to `target` (relative to the link's directory).
    Symlink {
        target: String,
    },
}

/// The multi-call iptables binaries and the names they answer to (argv[0]).
const XTABLES_MULTI: [(&str, &[&str]); 2] = [
    (
        "xtables-legacy-multi",
        &[
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
            "iptables-legacy",
            "ip6tables-legacy",
        ],
    ),
    (
        "xtables-nft-multi",
        &[
            "iptables-nft-save",
            "iptables-nft-restore",
            "ip6tables-nft-save",
            "ip6tables-nft-restore",
            "iptables-nft",
            "ip6tables-nft",
        ],
    ),
];
/// Where Debian's libxtables looks for match and target modules (its XTABLES_LIBDIR).
const XTABLES_MODULES: &str = "/usr/lib/x86_64-linux-gnu/xtables";
/// Prefixes of the modules iptables and ip6tables load (not ebtables' or arptables').
const XTABLES_MODULE_PREFIXES: [&str; 3] = ["libxt_", "libipt_", "libip6t_"];

/// What goes into the image, keyed by path (relative, no leading `/`).
fn image_entries(bin: &Path) -> Result<BTreeMap<String, Node>> {
    let mut e = BTreeMap::new();
    let read = |p: &Path| fs::read(p).with_context(|| format!("reading {}", p.display()));
    e.insert(
        "usr/local/bin/ferry".into(),
        Node::File {
            mode: 0o755,
            data: read(bin)?,
        },
    );
    // The CNI plugin `ferry agent --pod-network` installs on the node, from next to it.
    let cni = bin.with_file_name("ferry-cni");
    if !cni.exists() {
        bail!(
            "{} is missing: run `cargo xtask build` first",
            cni.display()
        );
    }
    e.insert(
        "usr/local/bin/ferry-cni".into(),
        Node::File {
            mode: 0o755,
            data: read(&cni)?,
        },
    );
    let mut needs_libraries = vec![bin.to_path_buf(), cni];
    for (multi, names) in XTABLES_MULTI {
        let path = host_tool(multi)?;
        e.insert(
            format!("usr/sbin/{multi}"),
            Node::File {
                mode: 0o755,
                data: read(&path)?,
            },
        );
        for name in names {
            e.insert(
                format!("usr/sbin/{name}"),
                Node::Symlink {
                    target: multi.to_string(),
                },
            );
        }
        needs_libraries.push(path);
    }
    let nft = host_tool("nft")?;
    e.insert(
        "usr/sbin/nft".into(),
        Node::File {
            mode: 0o755,
            data: read(&nft)?,
        },
    );
    needs_libraries.push(nft);
    for module in xtables_modules()? {
        e.insert(
            module.to_string_lossy().trim_start_matches('/').to_string(),
            Node::File {
                mode: 0o644,
                data: read(&module)?,
            },
        );
        needs_libraries.push(module);
    }
    let mut libs = BTreeSet::new();
    for exe in &needs_libraries {
        libs.extend(shared_libraries(exe)?);
    }
    for lib in libs {
        let rel = lib
            .strip_prefix("/")
            .with_context(|| format!("ldd printed a relative path {}", lib.display()))?;
        e.insert(
            rel.to_string_lossy().into_owned(),
            Node::File {
                mode: 0o755,
                data: read(&lib)?,
            },
        );
    }
    e.insert(
        "etc/protocols".into(),
        Node::File {
            mode: 0o644,
            data: read(Path::new("/etc/protocols"))?,
        },
    );
    add_base_files(&mut e)?;
    Ok(e)
}

/// CA certificates, a root-only /etc/passwd and /tmp: what every image has.
fn add_base_files(e: &mut BTreeMap<String, Node>) -> Result<()> {
    let ca = Path::new(CA_BUNDLE);
    if !ca.exists() {
        bail!("{CA_BUNDLE} is missing: install Debian's ca-certificates (`cargo xtask setup`)");
    }
    e.insert(
        CA_BUNDLE.trim_start_matches('/').into(),
        Node::File {
            mode: 0o644,
            data: fs::read(ca).with_context(|| format!("reading {CA_BUNDLE}"))?,
        },
    );
    e.insert(
        "etc/passwd".into(),
        Node::File {
            mode: 0o644,
            data: b"root:x:0:0:root:/root:/usr/sbin/nologin\n".to_vec(),
        },
    );
    e.insert("tmp".into(), Node::Dir { mode: 0o1777 });
    Ok(())
}

/// An image of one binary: `/usr/local/bin/<name>`, its libraries and the base files.
fn base_entries(bin: &Path, name: &str) -> Result<BTreeMap<String, Node>> {
    let mut e = BTreeMap::new();
    e.insert(
        format!("usr/local/bin/{name}"),
        Node::File {
            mode: 0o755,
            data: fs::read(bin).with_context(|| format!("reading {}", bin.display()))?,
        },
    );
    for lib in shared_libraries(bin)? {
        let data = fs::read(&lib).with_context(|| format!("reading {}", lib.display()))?;
        e.insert(
            lib.to_string_lossy().trim_start_matches('/').to_string(),
            Node::File { mode: 0o755, data },
        );
    }
    add_base_files(&mut e)?;
    Ok(e)
}

/// `name` from the host's sbin directories (Debian packages iptables and nftables).
fn host_tool(name: &str) -> Result<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} is missing: the image carries the host's iptables and nft for the \
                 kube-proxy takeover; install Debian's iptables and nftables (`cargo xtask setup`)"
            )
        })
}

/// The iptables and ip6tables match and target modules, sorted.
fn xtables_modules() -> Result<Vec<PathBuf>> {
    let dir = Path::new(XTABLES_MODULES);
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| {
        format!(
            "reading {}: install Debian's iptables (`cargo xtask setup`)",
            dir.display()
        )
    })? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.ends_with(".so") && XTABLES_MODULE_PREFIXES.iter().any(|p| name.starts_with(p)) {
            out.push(path);
        }
    }
    if out.is_empty() {
        bail!("{} has no iptables modules", dir.display());
    }
    out.sort();
    Ok(out)
}

/// The libraries and the loader `ldd` resolves for `bin` (none when it is static).
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running `ldd` (Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!(
            "ldd {} failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_ldd(&text)
}

fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("=> not found") {
            bail!("ldd: a library the image needs is missing on this machine: {line}");
        }
        // `name => /path (0x...)` or `/path/to/ld.so (0x...)`; vdso has no path.
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.trim(),
            None => line,
        };
        let path = path.split_whitespace().next().unwrap_or_default();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    libs.sort();
    libs.dedup();
    Ok(libs)
}

/// A tar (ustar) of `entries`, sorted by path, with every parent directory added
/// (0755); mtime `mtime`, uid/gid 0, no owner names.
pub(crate) fn tar(entries: &BTreeMap<String, Node>, mtime: u64) -> Vec<u8> {
    let mut all = entries.clone();
    for path in entries.keys() {
        let mut p = Path::new(path).parent();
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty()) {
            all.entry(dir.to_string_lossy().into_owned())
                .or_insert(Node::Dir { mode: 0o755 });
            p = dir.parent();
        }
    }
    let mut out = Vec::new();
    for (path, node) in &all {
        match node {
            Node::Dir { mode } => {
                out.extend_from_slice(&header(&format!("{path}/"), *mode, 0, b'5', mtime));
            }
            Node::File { mode, data } => {
                out.extend_from_slice(&header(path, *mode, data.len() as u64, b'0', mtime));
                out.extend_from_slice(data);
                out.resize(out.len().next_multiple_of(512), 0);
            }
            Node::Symlink { target } => {
                let mut h = header(path, 0o777, 0, b'2', mtime);
                assert!(target.len() <= 100, "symlink target too long: {target}");
                h[157..157 + target.len()].copy_from_slice(target.as_bytes());
                set_checksum(&mut h);
                out.extend_from_slice(&h);
            }
        }
    }
    // Two zero blocks end the archive.
    out.resize(out.len() + 1024, 0);
    out
}

/// A ustar header block. Paths longer than 100 bytes are split into prefix and name.
fn header(path: &str, mode: u32, size: u64, kind: u8, mtime: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    let (prefix, name) = if path.len() <= 100 {
        ("", path)
    } else {
        // Split at a '/' so that the name part fits in 100 bytes and the prefix in 155.
        let cut = path[..path.len().min(156)]
            .rfind('/')
            .filter(|&i| path.len() - i - 1 <= 100)
            .unwrap_or_else(|| panic!("path too long for ustar: {path}"));
        (&path[..cut], &path[cut + 1..])
    };
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], mode as u64);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], mtime);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    set_checksum(&mut h);
    h
}

/// The checksum is computed with its own field as spaces.
fn set_checksum(h: &mut [u8; 512]) {
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
}

/// Zero-padded octal, NUL-terminated, filling the field.
fn octal(field: &mut [u8], v: u64) {
    let w = field.len() - 1;
    let s = format!("{v:0w$o}");
    assert!(s.len() == w, "{v} does not fit a {w}-digit tar field");
    field[..w].copy_from_slice(s.as_bytes());
    field[w] = 0;
}

/// gzip with a fixed header: no name, mtime 0, OS byte 255 (unknown), level 9.
pub(crate) fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

pub(crate) fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

/// The image's blobs and their digests.
pub(crate) struct Image {
    pub(crate) layer_digest: String,
    pub(crate) manifest_digest: String,
    layer_gz: Vec<u8>,
    config: Vec<u8>,
    manifest: Vec<u8>,
}

impl Image {
    /// No `created` date in the config (it is optional): the digests then depend on the
    /// layer only.
    pub(crate) fn new(spec: Spec, layer_tar: &[u8], layer_gz: Vec<u8>) -> Image {
        let mut config = json!({
            "architecture": oci_arch(),
            "os": "linux",
            "config": {
                "Entrypoint": [format!("/usr/local/bin/{}", spec.binary)],
                "Cmd": [spec.cmd],
                "Env": [PATH_ENV],
                "WorkingDir": "/",
                "Labels": {
                    "org.opencontainers.image.title": spec.binary,
                    "org.opencontainers.image.version": VERSION,
                    "org.opencontainers.image.licenses": "Apache-2.0",
                },
            },
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer_tar)]},
            "history": [{"created_by": "cargo xtask image"}],
        });
        if spec.cmd.is_none() {
            config["config"]
                .as_object_mut()
                .expect("config object")
                .remove("Cmd");
        }
        let config = serde_json::to_vec(&config).expect("config json");
        let layer_digest = sha256(&layer_gz);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": {"mediaType": MT_CONFIG, "digest": sha256(&config), "size": config.len()},
            "layers": [{"mediaType": MT_LAYER, "digest": layer_digest, "size": layer_gz.len()}],
        });
        let manifest = serde_json::to_vec(&manifest).expect("manifest json");
        Image {
            layer_digest,
            manifest_digest: sha256(&manifest),
            layer_gz,
            config,
            manifest,
        }
    }

    /// The OCI layout (plus Docker's manifest.json) as one tar.
    pub(crate) fn archive(&self, spec: Spec, mtime: u64) -> Vec<u8> {
        let name = spec.image_ref();
        let index = json!({
            "schemaVersion": 2,
            "mediaType": MT_INDEX,
            "manifests": [{
                "mediaType": MT_MANIFEST,
                "digest": self.manifest_digest,
                "size": self.manifest.len(),
                "platform": {"architecture": oci_arch(), "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name,
                },
            }],
        });
        let blob = |d: &str| format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        let docker = json!([{
            "Config": blob(&sha256(&self.config)),
            "RepoTags": [name],
            "Layers": [blob(&self.layer_digest)],
        }]);
        let file = |data: Vec<u8>| Node::File { mode: 0o644, data };
        let mut e = BTreeMap::new();
        e.insert(
            "oci-layout".into(),
            file(br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
        );
        e.insert(
            "index.json".into(),
            file(serde_json::to_vec(&index).unwrap()),
        );
        e.insert(
            "manifest.json".into(),
            file(serde_json::to_vec(&docker).unwrap()),
        );
        for data in [&self.layer_gz, &self.config, &self.manifest] {
            e.insert(blob(&sha256(data)), file(data.clone()));
        }
        tar(&e, mtime)
    }
}

fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BTreeMap<String, Node> {
        let mut e = BTreeMap::new();
        e.insert(
            "usr/local/bin/ferry".to_string(),
            Node::File {
                mode: 0o755,
                data: b"\x7fELF not really".to_vec(),
            },
        );
        e.insert(
            "etc/passwd".to_string(),
            Node::File {
                mode: 0o644,
                data: b"root:x:0:0::/:/x\n".to_vec(),
            },
        );
        e.insert("tmp".to_string(), Node::Dir { mode: 0o1777 });
        e.insert(
            "usr/sbin/iptables-nft-save".to_string(),
            Node::Symlink {
                target: "xtables-nft-multi".into(),
            },
        );
        e
    }

    /// Paths and kinds of a tar, as `tar tv` would list them.
    fn listing(t: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + 512 <= t.len() && t[off] != 0 {
            let h = &t[off..off + 512];
            let field = |r: std::ops::Range<usize>| {
                String::from_utf8_lossy(&h[r])
                    .trim_end_matches('\0')
                    .to_string()
            };
            let size = u64::from_str_radix(&field(124..135), 8).unwrap() as usize;
            let sum = u32::from_str_radix(field(148..154).trim(), 8).unwrap();
            let mut blank = h.to_vec();
            blank[148..156].fill(b' ');
            assert_eq!(
                sum,
                blank.iter().map(|&b| b as u32).sum::<u32>(),
                "checksum"
            );
            let link = field(157..257);
            out.push(format!(
                "{} {} uid={} mtime={} {}{}",
                h[156] as char,
                field(100..107),
                field(108..115),
                u64::from_str_radix(&field(136..147), 8).unwrap(),
                field(0..100),
                if link.is_empty() {
                    String::new()
                } else {
                    format!(" -> {link}")
                }
            ));
            off += 512 + size.next_multiple_of(512);
        }
        out
    }

    #[test]
    fn layer_is_sorted_with_parents_fixed_owner_and_mtime() {
        let t = tar(&sample(), 0);
        assert_eq!(
            listing(&t),
            [
                "5 0000755 uid=0000000 mtime=0 etc/",
                "0 0000644 uid=0000000 mtime=0 etc/passwd",
                "5 0001777 uid=0000000 mtime=0 tmp/",
                "5 0000755 uid=0000000 mtime=0 usr/",
                "5 0000755 uid=0000000 mtime=0 usr/local/",
                "5 0000755 uid=0000000 mtime=0 usr/local/bin/",
                "0 0000755 uid=0000000 mtime=0 usr/local/bin/ferry",
                "5 0000755 uid=0000000 mtime=0 usr/sbin/",
                "2 0000777 uid=0000000 mtime=0 usr/sbin/iptables-nft-save -> xtables-nft-multi",
            ]
        );
        assert_eq!(t.len() % 512, 0);
    }

    #[test]
    fn same_input_gives_same_digests() {
        let a_tar = tar(&sample(), 0);
        let b_tar = tar(&sample(), 0);
        let a = Image::new(FERRY, &a_tar, gzip(&a_tar).unwrap());
        let b = Image::new(FERRY, &b_tar, gzip(&b_tar).unwrap());
        assert_eq!(a.layer_digest, b.layer_digest);
        assert_eq!(a.manifest_digest, b.manifest_digest);
        assert_eq!(sha256(&a.archive(FERRY, 0)), sha256(&b.archive(FERRY, 0)));
        // A different SOURCE_DATE_EPOCH is a different layer.
        let c_tar = tar(&sample(), 1_700_000_000);
        assert_ne!(sha256(&a_tar), sha256(&c_tar));
        // gzip header: magic, deflate, no flags, mtime 0, OS 255.
        let gz = gzip(&a_tar).unwrap();
        assert_eq!(&gz[..10], &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 2, 255]);
    }

    #[test]
    fn ldd_output_is_parsed() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x1)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x2)\n\t/lib64/ld-linux-x86-64.so.2 (0x3)\n";
        assert_eq!(
            parse_ldd(text).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(parse_ldd("\tlibfoo.so => not found\n").is_err());
    }
}
