//! The `--manifests DIR` source: Services and EndpointSlices read from files, and Nodes
//! (for `--pod-network`, which routes to their pod CIDRs).
//!
//! Every `*.yaml`, `*.yml` and `*.json` file directly in DIR is parsed (multi-document
//! YAML, JSON, or a `kind: List`), exactly as `kubectl get -o yaml|json` writes objects.
//! Each file is all-or-nothing: while any of its documents is broken, the objects of its
//! last good content stay in place and the problem is reported with `file:line[:column]`.
//! Files are polled, not watched: simple, and it works on every filesystem (including
//! ConfigMap volumes, whose files are symlinks swapped atomically).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::fs;
use std::hash::{DefaultHasher, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::Resource as _;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use super::defs::{DefIndex, DefKey};
use super::store::{DEFAULT_NAMESPACE, ObjectKey, Objects};
use super::{ServiceLite, SliceLite, SourceEvent};

/// Where a problem is in a file: `path:line` or `path:line:column` (1-based).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position {
    pub path: PathBuf,
    pub line: usize,
    pub column: Option<usize>,
}

impl Position {
    fn new(path: &Path, line: usize, column: Option<usize>) -> Self {
        Self {
            path: path.to_owned(),
            line,
            column,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.line)?;
        if let Some(column) = self.column {
            write!(f, ":{column}")?;
        }
        Ok(())
    }
}

/// A problem with the manifests; each message says where it is and what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// DIR is missing, not a directory or unreadable. During a rescan the objects
    /// already read stay in place: a transient mount problem must not drop every Service.
    #[error(
        "{}: cannot read the manifests directory: {reason}; create it or pass an existing directory to --manifests",
        dir.display()
    )]
    Dir { dir: PathBuf, reason: String },

    /// A manifest file could not be read.
    #[error("{}: cannot read file: {reason}; fix its permissions, its previous objects stay programmed", path.display())]
    Read { path: PathBuf, reason: String },

    /// The file is not valid YAML, JSON or UTF-8 text.
    #[error(
        "{at}: invalid {format}: {message}; fix the file, its previous objects stay programmed"
    )]
    Syntax {
        at: Position,
        format: &'static str,
        message: String,
    },

    /// A document parsed but is not a valid object; `at` is the line the document starts on.
    #[error("{at}: {object}: {message}; fix the file, its previous objects stay programmed")]
    Object {
        at: Position,
        object: String,
        message: String,
    },

    /// The same object (e.g. `Service shop/web`) is defined twice; the one read last
    /// (in path order) is used.
    #[error(
        "{at}: {object} is also defined at {first}; the one read last (in path order) is used, remove the other"
    )]
    Duplicate {
        at: Position,
        first: Position,
        object: String,
    },
}

impl ManifestError {
    /// Warnings do not stop anything from being programmed.
    pub fn is_warning(&self) -> bool {
        matches!(self, Self::Duplicate { .. })
    }
}

/// What one [`ManifestsSource::rescan`] found.
#[derive(Debug, Default)]
pub struct ScanOutcome {
    /// The merged objects differ from those of the previous scan.
    pub changed: bool,
    /// Every current problem (not only new ones), warnings included.
    pub errors: Vec<ManifestError>,
}

/// Fails fast (the CLI exits with code 2) when DIR is not a readable directory.
pub fn check_dir(dir: &Path) -> Result<(), ManifestError> {
    fs::read_dir(dir)
        .map(drop)
        .map_err(|err| dir_error(dir, &err))
}

/// A directory of manifests, rescanned on demand; remembers each file's last good objects.
///
/// The merged view is kept up to date through the keys a changed file touches (see
/// [`super::defs`]), and the objects that changed are handed out as events
/// ([`ManifestsSource::take_update`]): one changed file among many costs its own parse
/// and its own objects, not a merge and a diff of every file.
#[derive(Debug)]
pub struct ManifestsSource {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    merged: Merged,
    duplicates: Vec<ManifestError>,
    /// Which file defines each object.
    index: DefIndex,
    /// Objects of the merged view changed since the last [`Self::take_update`].
    pending: Pending,
    /// How many times a file was parsed (tests check that unchanged files are not).
    parses: usize,
}

/// The winning definition of each object, shared with the file that holds it: Services
/// and slices compact, as the agent keeps them (a k8s-openapi object of each, per file
/// and merged, cost ~1.4 GiB at 100,000 Services).
#[derive(Debug, Default)]
struct Merged {
    services: BTreeMap<ObjectKey, Arc<ServiceLite>>,
    slices: BTreeMap<ObjectKey, Arc<SliceLite>>,
    nodes: BTreeMap<String, Node>,
}

/// Keys whose merged object changed (or went away) since the last update was taken.
#[derive(Debug, Default)]
struct Pending {
    services: BTreeSet<ObjectKey>,
    slices: BTreeSet<ObjectKey>,
    nodes: bool,
}

/// What changed in the merged view since the previous [`ManifestsSource::take_update`].
#[derive(Debug, Default)]
pub struct Update {
    /// One event per changed Service or EndpointSlice, for the agent's store.
    pub events: Vec<SourceEvent>,
    /// Every Node, when any of them changed (the pod network reads them whole).
    pub nodes: Option<BTreeMap<String, Node>>,
}

impl Update {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty() && self.nodes.is_none()
    }
}

impl ManifestsSource {
    /// A source that has read nothing yet: call [`Self::rescan`] (or [`watch`]).
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            files: BTreeMap::new(),
            merged: Merged::default(),
            duplicates: Vec::new(),
            index: DefIndex::default(),
            pending: Pending::default(),
            parses: 0,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The merged objects of every file, as of the last rescan, as API objects with the
    /// fields ferry reads ([`ServiceLite::to_k8s`]).
    pub fn objects(&self) -> Objects {
        Objects {
            services: (self.merged.services.iter())
                .map(|(k, s)| (k.clone(), s.to_k8s()))
                .collect(),
            slices: (self.merged.slices.iter())
                .map(|(k, s)| (k.clone(), s.to_k8s()))
                .collect(),
            nodes: self.merged.nodes.clone(),
        }
    }

    /// The merged Services, compact.
    pub fn services(&self) -> impl Iterator<Item = &ServiceLite> {
        self.merged.services.values().map(|s| &**s)
    }

    /// The merged EndpointSlices, compact.
    pub fn slices(&self) -> impl Iterator<Item = &SliceLite> {
        self.merged.slices.values().map(|s| &**s)
    }

    /// The merged Nodes, by name.
    pub fn nodes(&self) -> &BTreeMap<String, Node> {
        &self.merged.nodes
    }

    /// The Services and EndpointSlices that changed since the previous call (or since
    /// the source was made), as events, in key order: applied when an object is (still)
    /// defined, deleted when not. An object ferry cannot use (see [`ServiceLite`]) is
    /// reported deleted, as a full list would leave it out.
    pub fn take_update(&mut self) -> Update {
        let pending = std::mem::take(&mut self.pending);
        let mut events = Vec::with_capacity(pending.services.len() + pending.slices.len());
        for k in pending.services {
            events.push(match self.merged.services.get(&k) {
                Some(svc) => SourceEvent::ServiceApplied(ServiceLite::clone(svc)),
                None => SourceEvent::ServiceDeleted(k),
            });
        }
        for k in pending.slices {
            events.push(match self.merged.slices.get(&k) {
                Some(slice) => SourceEvent::SliceApplied(SliceLite::clone(slice)),
                None => SourceEvent::SliceDeleted(k),
            });
        }
        let nodes = pending.nodes.then(|| self.merged.nodes.clone());
        Update { events, nodes }
    }

    /// Reads DIR again, reparsing only files whose content changed.
    pub fn rescan(&mut self) -> ScanOutcome {
        let paths = match list_manifests(&self.dir) {
            Ok(paths) => paths,
            // Keep everything: far safer than dropping every Service on a mount hiccup.
            Err(err) => {
                return ScanOutcome {
                    changed: false,
                    errors: vec![err],
                };
            }
        };
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|path| !paths.contains(*path))
            .cloned()
            .collect();
        for path in gone {
            self.forget(&path);
        }
        for path in paths {
            self.refresh(path);
        }
        let changed = self.remerge();
        let errors = self
            .files
            .values()
            .flat_map(|state| state.errors.iter())
            .chain(&self.duplicates)
            .cloned()
            .collect();
        ScanOutcome { changed, errors }
    }

    /// Brings one file's state up to date with what is on disk.
    fn refresh(&mut self, path: PathBuf) {
        let previous = self.files.get(&path).and_then(|state| state.seen.as_ref());
        match load(&path, previous) {
            Load::Unchanged => {}
            Load::Gone => self.forget(&path),
            Load::Failed(reason) => {
                let state = self.files.entry(path.clone()).or_default();
                // Forget the hash so that the next successful read is parsed again.
                state.seen = None;
                state.errors = vec![ManifestError::Read { path, reason }];
            }
            Load::Read { seen, bytes } => self.update(path, seen, &bytes),
        }
    }

    /// Records freshly read content, parsing it unless its hash is the one already parsed.
    fn update(&mut self, path: PathBuf, seen: Seen, bytes: &[u8]) {
        let previous = self.files.get(&path).and_then(|state| state.seen.as_ref());
        let parsed = if previous.is_some_and(|old| old.hash == seen.hash) {
            None
        } else {
            self.parses += 1;
            Some(parse_file(&path, bytes))
        };
        let state = self.files.entry(path.clone()).or_default();
        state.seen = Some(seen);
        match parsed {
            None => {}
            Some(Ok(found)) => {
                self.index.remove_file(&path, def_keys(&state.good));
                state.good = found;
                state.errors.clear();
                self.index.add_file(
                    &path,
                    state
                        .good
                        .iter()
                        .map(|found| (found.kind(), &found.key, found.line)),
                );
            }
            // All or nothing: the last good objects stay until the file is fixed.
            Some(Err(errors)) => state.errors = errors,
        }
    }

    /// Drops a file that is gone, with its objects.
    fn forget(&mut self, path: &Path) {
        if let Some(state) = self.files.remove(path) {
            self.index.remove_file(path, def_keys(&state.good));
        }
    }

    /// Brings the merged view up to date for the objects whose definitions changed;
    /// returns whether any merged object changed.
    fn remerge(&mut self) -> bool {
        let mut changed = false;
        for (key, winner) in self.index.take_touched() {
            let object = winner.and_then(|def| {
                let found = self.files.get(&*def.path)?.good.get(def.index)?;
                Some(&found.object)
            });
            changed |= merge_one(&mut self.merged, &mut self.pending, key, object);
        }
        self.duplicates = self
            .index
            .duplicates()
            .into_iter()
            .map(|dup| ManifestError::Duplicate {
                at: Position::new(&dup.at.path, dup.at.line, None),
                first: Position::new(&dup.first.path, dup.first.line, None),
                object: format!("{} {}", dup.key.0, dup.key.1),
            })
            .collect();
        changed
    }
}

/// How many files (or the directory itself) fail to read or parse now; warnings do not
/// count. This is the `ferry_source_errors` metric.
pub fn failing_files(errors: &[ManifestError]) -> usize {
    let paths: BTreeSet<&Path> = errors
        .iter()
        .filter_map(|err| match err {
            ManifestError::Dir { dir: path, .. } | ManifestError::Read { path, .. } => {
                Some(path.as_path())
            }
            ManifestError::Syntax { at, .. } | ManifestError::Object { at, .. } => {
                Some(at.path.as_path())
            }
            ManifestError::Duplicate { .. } => None,
        })
        .collect();
    paths.len()
}

/// Runs the source forever: rescans every `interval`, logs each distinct problem once
/// (until its text changes) and sends what changed ([`ManifestsSource::take_update`])
/// whenever something did. Returns only when the receiver is gone.
pub async fn watch(src: ManifestsSource, interval: Duration, tx: mpsc::UnboundedSender<Update>) {
    watch_with(src, interval, tx, |_| {}).await
}

/// [`watch`], also handing every scan's outcome to `on_scan` (for status reporting).
pub async fn watch_with(
    mut src: ManifestsSource,
    interval: Duration,
    tx: mpsc::UnboundedSender<Update>,
    mut on_scan: impl FnMut(&ScanOutcome) + Send + 'static,
) {
    // `interval` panics on zero; a zero interval would spin anyway.
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut reported = HashSet::new();
    loop {
        ticker.tick().await;
        // File I/O blocks; keep it off the async workers (DIR may be on a slow mount).
        let scan = tokio::task::spawn_blocking(move || {
            let outcome = src.rescan();
            let update = src.take_update();
            (src, outcome, update)
        });
        let (outcome, update) = match scan.await {
            Ok((back, outcome, update)) => {
                src = back;
                (outcome, update)
            }
            Err(err) => {
                tracing::error!(
                    "manifests: rescan of the directory failed: {err}; no more updates"
                );
                return;
            }
        };
        report(&mut reported, &outcome.errors);
        on_scan(&outcome);
        if !update.is_empty() {
            tracing::info!(
                changed = update.events.len(),
                nodes = update.nodes.is_some(),
                services = src.merged.services.len(),
                slices = src.merged.slices.len(),
                "manifests changed"
            );
            if tx.send(update).is_err() {
                return;
            }
        }
    }
}

/// Logs the problems not logged at the previous scan, so a broken file is not
/// reported again on every tick; returns how many were logged.
fn report(reported: &mut HashSet<String>, errors: &[ManifestError]) -> usize {
    let mut current = HashSet::new();
    let mut logged = 0;
    for err in errors {
        let text = err.to_string();
        if !reported.contains(&text) && !current.contains(&text) {
            logged += 1;
            if err.is_warning() {
                tracing::warn!("{text}");
            } else {
                tracing::error!("{text}");
            }
        }
        current.insert(text);
    }
    if current.is_empty() && !reported.is_empty() {
        tracing::info!("manifests: all problems are fixed");
    }
    *reported = current;
    logged
}

// ---------------------------------------------------------------------------------
// Files on disk

/// What we remember of one file between scans.
#[derive(Debug, Default)]
struct FileState {
    /// The content last read, `None` if it could not be read.
    seen: Option<Seen>,
    /// The objects of the last content that parsed fully.
    good: Vec<Found>,
    /// The problems of the current content.
    errors: Vec<ManifestError>,
}

/// The stamp and hash of a file's content when it was read.
#[derive(Debug)]
struct Seen {
    len: u64,
    modified: Option<SystemTime>,
    read_at: SystemTime,
    hash: u64,
}

/// Some filesystems keep mtimes to the second (or two, on FAT).
const MTIME_GRANULARITY: Duration = Duration::from_secs(2);

impl Seen {
    /// Whether the file surely still holds the content we hashed, without reading it:
    /// its (mtime, len) are unchanged *and* it had been untouched for longer than the
    /// mtime granularity when we read it, so a later write must have moved its mtime.
    fn still_valid(&self, meta: &fs::Metadata) -> bool {
        let modified = meta.modified().ok();
        let settled = modified
            .and_then(|m| m.checked_add(MTIME_GRANULARITY))
            .is_some_and(|limit| limit < self.read_at);
        settled && modified == self.modified && meta.len() == self.len
    }
}

enum Load {
    Unchanged,
    /// Removed, or no longer a regular file.
    Gone,
    Failed(String),
    Read {
        seen: Seen,
        bytes: Vec<u8>,
    },
}

/// Reads a file unless its stamp proves the content is the one seen before.
fn load(path: &Path, previous: Option<&Seen>) -> Load {
    let read_at = SystemTime::now();
    // `metadata` follows symlinks: ConfigMap volumes are made of them.
    let meta = match fs::metadata(path) {
        Ok(meta) if meta.is_file() => meta,
        Ok(_) => return Load::Gone,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Load::Gone,
        Err(err) => return Load::Failed(err.to_string()),
    };
    if previous.is_some_and(|seen| seen.still_valid(&meta)) {
        return Load::Unchanged;
    }
    match fs::read(path) {
        Ok(bytes) => {
            let seen = Seen {
                len: meta.len(),
                modified: meta.modified().ok(),
                read_at,
                hash: hash(&bytes),
            };
            Load::Read { seen, bytes }
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => Load::Gone,
        Err(err) => Load::Failed(err.to_string()),
    }
}

fn hash(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write(bytes);
    hasher.finish()
}

/// The manifest files directly in `dir`, in path order.
fn list_manifests(dir: &Path) -> Result<BTreeSet<PathBuf>, ManifestError> {
    let mut paths = BTreeSet::new();
    for entry in fs::read_dir(dir).map_err(|err| dir_error(dir, &err))? {
        let entry = entry.map_err(|err| dir_error(dir, &err))?;
        if is_manifest_name(&entry.file_name().to_string_lossy()) {
            paths.insert(entry.path());
        }
    }
    Ok(paths)
}

/// `*.yaml`, `*.yml` and `*.json`, but not hidden files nor editor leftovers
/// (`.web.yaml.swp`, `web.yaml~`, emacs' `.#web.yaml`).
fn is_manifest_name(name: &str) -> bool {
    if name.starts_with('.') || name.ends_with('~') {
        return false;
    }
    let extension = Path::new(name)
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    matches!(extension.as_deref(), Some("yaml" | "yml" | "json"))
}

fn dir_error(dir: &Path, err: &io::Error) -> ManifestError {
    let reason = match err.kind() {
        io::ErrorKind::NotFound => "it does not exist".to_owned(),
        io::ErrorKind::NotADirectory => "it is not a directory".to_owned(),
        _ => err.to_string(),
    };
    ManifestError::Dir {
        dir: dir.to_owned(),
        reason,
    }
}

// ---------------------------------------------------------------------------------
// Parsing

/// An object read from a file.
#[derive(Clone, Debug)]
struct Found {
    key: ObjectKey,
    /// The line its document starts on.
    line: usize,
    object: Object,
}

/// Services and slices compact from the parse on (what the agent reads of them), shared
/// with the merged view when they win.
#[derive(Clone, Debug)]
enum Object {
    Service(Arc<ServiceLite>),
    Slice(Arc<SliceLite>),
    Node(Box<Node>),
}

impl Found {
    fn kind(&self) -> &'static str {
        match self.object {
            Object::Service(_) => "Service",
            Object::Slice(_) => "EndpointSlice",
            Object::Node(_) => "Node",
        }
    }
}

/// One document of a file and the line it starts on.
struct Doc {
    line: usize,
    value: Value,
}

/// Parses one file, all or nothing: a problem in any document fails the whole file.
fn parse_file(path: &Path, bytes: &[u8]) -> Result<Vec<Found>, Vec<ManifestError>> {
    let text = decode(path, bytes).map_err(|err| vec![err])?;
    let docs = if has_extension(path, "json") {
        json_documents(path, text)
    } else {
        yaml_documents(path, text)
    };
    let mut found = Vec::new();
    let mut errors = Vec::new();
    for doc in docs {
        match doc.and_then(|doc| objects_of(&Position::new(path, doc.line, None), doc.value, "")) {
            Ok(objects) => found.extend(objects),
            Err(err) => errors.push(err),
        }
    }
    if errors.is_empty() {
        Ok(found)
    } else {
        Err(errors)
    }
}

fn has_extension(path: &Path, wanted: &str) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case(wanted))
}

/// The file as text, without the BOM some editors write.
fn decode<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str, ManifestError> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    std::str::from_utf8(bytes).map_err(|err| {
        let before = &bytes[..err.valid_up_to()];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = before.len()
            - before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1)
            + 1;
        ManifestError::Syntax {
            at: Position::new(path, line, Some(column)),
            format: "UTF-8",
            message: "the file must be UTF-8 text".to_owned(),
        }
    })
}

/// A `.json` file holds one document (a `kind: List` for several objects).
fn json_documents(path: &Path, text: &str) -> Vec<Result<Doc, ManifestError>> {
    let Some(line) = text
        .lines()
        .position(|l| !l.trim().is_empty())
        .map(|i| i + 1)
    else {
        return Vec::new();
    };
    let doc = serde_json::from_str(text)
        .map(|value| Doc { line, value })
        .map_err(|err| {
            let column = (err.column() > 0).then_some(err.column());
            ManifestError::Syntax {
                at: Position::new(path, err.line().max(1), column),
                format: "JSON",
                message: strip_positions(&err.to_string()),
            }
        });
    vec![doc]
}

/// Each YAML document is parsed on its own so that we know the line it starts on
/// (serde_yaml does not tell) and can place its errors in the whole file.
fn yaml_documents(path: &Path, text: &str) -> Vec<Result<Doc, ManifestError>> {
    split_yaml(text)
        .into_iter()
        .filter_map(|chunk| {
            let line = chunk.content_line?;
            Some(
                serde_yaml::from_str(chunk.text)
                    .map(|value| Doc { line, value })
                    .map_err(|err| {
                        let (line, column) = match err.location() {
                            Some(at) => (chunk.first_line + at.line() - 1, Some(at.column())),
                            None => (line, None),
                        };
                        ManifestError::Syntax {
                            at: Position::new(path, line, column),
                            format: "YAML",
                            message: strip_positions(&err.to_string()),
                        }
                    }),
            )
        })
        .collect()
}

/// The text of one YAML document, from its `---` marker (if any) to the next one.
#[derive(Debug, PartialEq)]
struct Chunk<'a> {
    text: &'a str,
    /// The line `text` starts on in the file.
    first_line: usize,
    /// The first line with content, `None` for a chunk of only comments and markers.
    content_line: Option<usize>,
}

/// Splits a file at its document markers. A `---` at column 0 always starts a new
/// document in YAML (it may not appear inside scalars), so this is exact.
fn split_yaml(text: &str) -> Vec<Chunk<'_>> {
    let mut chunks = Vec::new();
    let mut current = Chunk {
        text: "",
        first_line: 1,
        content_line: None,
    };
    let (mut start, mut offset) = (0, 0);
    for (index, line) in text.split_inclusive('\n').enumerate() {
        let number = index + 1;
        if is_document_start(line) && offset > start {
            current.text = &text[start..offset];
            chunks.push(current);
            current = Chunk {
                text: "",
                first_line: number,
                content_line: None,
            };
            start = offset;
        }
        if current.content_line.is_none() && has_content(line) {
            current.content_line = Some(number);
        }
        offset += line.len();
    }
    current.text = &text[start..];
    chunks.push(current);
    chunks
}

fn is_document_start(line: &str) -> bool {
    line.starts_with("---")
        && matches!(
            line.as_bytes().get(3),
            None | Some(b' ' | b'\t' | b'\r' | b'\n')
        )
}

/// Whether a line holds more than markers, directives, comments or blanks.
fn has_content(line: &str) -> bool {
    let is_end = line.starts_with("...") && line[3..].trim().is_empty();
    let rest = if is_document_start(line) {
        &line[3..]
    } else {
        line
    };
    let rest = rest.trim();
    !(is_end || line.starts_with('%') || rest.is_empty() || rest.starts_with('#'))
}

/// Drops the " at line L column C" (or " at position N") that serde_yaml and
/// serde_json put in their messages: they are relative to the text they parsed,
/// and the absolute position is printed in front of the message anyway.
fn strip_positions(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(found) = rest.find(" at ") {
        out.push_str(&rest[..found]);
        let after = &rest[found + 4..];
        match position_len(after) {
            Some(len) => rest = &after[len..],
            None => {
                out.push_str(" at ");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The length of a leading `line L column C` or `position N`, if `text` starts with one.
fn position_len(text: &str) -> Option<usize> {
    fn number(text: &str) -> Option<usize> {
        let digits = text.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0).then_some(digits)
    }
    if let Some(after) = text.strip_prefix("position ") {
        return Some("position ".len() + number(after)?);
    }
    let after = text.strip_prefix("line ")?;
    let line = number(after)?;
    let column = after[line..].strip_prefix(" column ")?;
    Some("line ".len() + line + " column ".len() + number(column)?)
}

/// The objects of one document: none for an empty document or another kind,
/// several for a `kind: List`. `item` names the List item being read, if any.
fn objects_of(at: &Position, value: Value, item: &str) -> Result<Vec<Found>, ManifestError> {
    let map = match value {
        Value::Null if item.is_empty() => return Ok(Vec::new()),
        Value::Object(map) => map,
        _ => {
            return Err(object_error(
                at,
                &format!("{item}document"),
                "expected a mapping with apiVersion and kind",
            ));
        }
    };
    let what = describe(&map, item);
    // The object (Services and slices compact), and its key: `None` without a name.
    let (found, key) = match str_field(&map, "kind") {
        Some("List") if item.is_empty() => return list_items(at, map, &what),
        Some("Service") => {
            let service: Service = decode_object(at, map, &what)?;
            let lite = ServiceLite::from_k8s(&service);
            let key = ObjectKey::from_meta(&service.metadata);
            (lite.map(|l| Object::Service(Arc::new(l))), key)
        }
        Some("EndpointSlice") => {
            let slice: EndpointSlice = decode_object(at, map, &what)?;
            let lite = SliceLite::from_k8s(&slice);
            let key = ObjectKey::from_meta(&slice.metadata);
            (lite.map(|l| Object::Slice(Arc::new(l))), key)
        }
        Some("Node") => {
            check_api_version(at, &map, Node::API_VERSION, &what)?;
            let node: Node = serde_json::from_value(Value::Object(map))
                .map_err(|err| object_error(at, &what, &err.to_string()))?;
            // Cluster-scoped: no namespace.
            let key = (node.metadata.name.as_deref())
                .filter(|n| !n.is_empty())
                .map(|n| ObjectKey::new("", n));
            (Some(Object::Node(Box::new(node))), key)
        }
        Some(kind) => {
            tracing::debug!(file = %at, kind, "manifests: ignoring an object of a kind ferry does not use");
            return Ok(Vec::new());
        }
        None => {
            return Err(object_error(
                at,
                &what,
                "no `kind`; every object needs apiVersion and kind",
            ));
        }
    };
    let (Some(found), Some(key)) = (found, key) else {
        return Err(object_error(at, &what, "metadata.name is missing"));
    };
    Ok(vec![Found {
        key,
        line: at.line,
        object: found,
    }])
}

/// The items of a `kind: List` (what `kubectl get -o yaml` writes for several objects).
fn list_items(
    at: &Position,
    mut map: Map<String, Value>,
    what: &str,
) -> Result<Vec<Found>, ManifestError> {
    check_api_version(at, &map, "v1", what)?;
    let items = match map.remove("items") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(object_error(at, what, "`items` must be a list of objects")),
    };
    let mut found = Vec::new();
    for (index, item) in items.into_iter().enumerate() {
        found.extend(objects_of(at, item, &format!("items[{index}]: "))?);
    }
    Ok(found)
}

/// Deserializes a Service or EndpointSlice, defaulting its namespace as the API server would.
fn decode_object<T>(at: &Position, map: Map<String, Value>, what: &str) -> Result<T, ManifestError>
where
    T: DeserializeOwned + k8s_openapi::Metadata<Ty = ObjectMeta>,
{
    check_api_version(at, &map, T::API_VERSION, what)?;
    let mut object: T = serde_json::from_value(Value::Object(map))
        .map_err(|err| object_error(at, what, &err.to_string()))?;
    let meta = object.metadata_mut();
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some(DEFAULT_NAMESPACE.to_owned());
    }
    Ok(object)
}

fn check_api_version(
    at: &Position,
    map: &Map<String, Value>,
    wanted: &str,
    what: &str,
) -> Result<(), ManifestError> {
    match str_field(map, "apiVersion") {
        Some(api) if api == wanted => Ok(()),
        Some(api) => Err(object_error(
            at,
            what,
            &format!("apiVersion {api} is not supported, use apiVersion: {wanted}"),
        )),
        None => Err(object_error(
            at,
            what,
            &format!("apiVersion is missing, use apiVersion: {wanted}"),
        )),
    }
}

/// Names an object as well as its raw fields allow, e.g. `Service default/web`.
fn describe(map: &Map<String, Value>, item: &str) -> String {
    let kind = str_field(map, "kind").unwrap_or("object");
    let meta = map.get("metadata");
    let field = |name| {
        meta.and_then(|m| m.get(name))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    match field("name") {
        Some(name) => format!(
            "{item}{kind} {}/{name}",
            field("namespace").unwrap_or(DEFAULT_NAMESPACE)
        ),
        None => format!("{item}{kind}"),
    }
}

fn str_field<'a>(map: &'a Map<String, Value>, name: &str) -> Option<&'a str> {
    map.get(name).and_then(Value::as_str)
}

fn object_error(at: &Position, object: &str, message: &str) -> ManifestError {
    ManifestError::Object {
        at: at.clone(),
        object: object.to_owned(),
        message: message.to_owned(),
    }
}

// ---------------------------------------------------------------------------------
// Merging

/// The (kind, key) of each object of a file, as the index knows them.
fn def_keys(good: &[Found]) -> impl Iterator<Item = (&'static str, &ObjectKey)> {
    good.iter().map(|found| (found.kind(), &found.key))
}

/// Puts an object's winning definition (or its absence) into the merged view; returns
/// whether the merged view changed, and records the key in `pending` if so.
fn merge_one(
    merged: &mut Merged,
    pending: &mut Pending,
    (kind, key): DefKey,
    object: Option<&Object>,
) -> bool {
    match (kind, object) {
        (_, Some(Object::Service(svc))) => {
            if merged.services.get(&key) == Some(svc) {
                return false;
            }
            merged.services.insert(key.clone(), svc.clone());
            pending.services.insert(key);
        }
        (_, Some(Object::Slice(slice))) => {
            if merged.slices.get(&key) == Some(slice) {
                return false;
            }
            merged.slices.insert(key.clone(), slice.clone());
            pending.slices.insert(key);
        }
        (_, Some(Object::Node(node))) => {
            if merged.nodes.get(&*key.name) == Some(&**node) {
                return false;
            }
            merged.nodes.insert(key.name.to_string(), Node::clone(node));
            pending.nodes = true;
        }
        ("Service", None) => {
            if merged.services.remove(&key).is_none() {
                return false;
            }
            pending.services.insert(key);
        }
        ("EndpointSlice", None) => {
            if merged.slices.remove(&key).is_none() {
                return false;
            }
            pending.slices.insert(key);
        }
        (_, None) => {
            if merged.nodes.remove(&*key.name).is_none() {
                return false;
            }
            pending.nodes = true;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVICE_WEB: &str = "\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  selector:
    app: web
  ports:
  - port: 80
    targetPort: 8080
";

    const SLICE_WEB: &str = "\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.0.0.5]
  conditions: {ready: true}
ports:
- port: 8080
";

    /// What `kubectl get svc,endpointslice -o yaml` prints: keys sorted, managedFields, status.
    const KUBECTL_OUTPUT: &str = r#"apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      kubectl.kubernetes.io/last-applied-configuration: |
        {"apiVersion":"v1","kind":"Service","metadata":{"annotations":{},"name":"api","namespace":"shop"}}
    creationTimestamp: "2024-05-01T10:00:00Z"
    labels:
      app: api
    managedFields:
    - apiVersion: v1
      fieldsType: FieldsV1
      fieldsV1:
        f:spec:
          f:ports:
            .: {}
            k:{"port":80,"protocol":"TCP"}:
              .: {}
              f:port: {}
      manager: kubectl-client-side-apply
      operation: Update
      time: "2024-05-01T10:00:00Z"
    name: api
    namespace: shop
    resourceVersion: "12345"
    uid: 6b7c0a4e-4f7e-4a3e-9a55-0d1f3c0e9b21
  spec:
    clusterIP: 10.96.0.20
    clusterIPs:
    - 10.96.0.20
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ipFamilyPolicy: SingleStack
    ports:
    - name: http
      port: 80
      protocol: TCP
      targetPort: http
    selector:
      app: api
    sessionAffinity: None
    type: ClusterIP
  status:
    loadBalancer: {}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 10.244.1.5
    conditions:
      ready: true
      serving: true
      terminating: false
    nodeName: node-a
    targetRef:
      kind: Pod
      name: api-7d9f-abcde
      namespace: shop
      uid: 0b1c2d3e-0000-4000-8000-000000000001
  kind: EndpointSlice
  metadata:
    creationTimestamp: "2024-05-01T10:00:01Z"
    generateName: api-
    generation: 3
    labels:
      endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
      kubernetes.io/service-name: api
    name: api-x7k2p
    namespace: shop
    ownerReferences:
    - apiVersion: v1
      blockOwnerDeletion: true
      controller: true
      kind: Service
      name: api
      uid: 6b7c0a4e-4f7e-4a3e-9a55-0d1f3c0e9b21
    resourceVersion: "12350"
    uid: 0b1c2d3e-0000-4000-8000-000000000002
  ports:
  - name: http
    port: 8080
    protocol: TCP
kind: List
metadata:
  resourceVersion: ""
"#;

    struct Fixture {
        dir: tempfile::TempDir,
        src: ManifestsSource,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let src = ManifestsSource::new(dir.path().to_owned());
            Self { dir, src }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        fn write(&self, name: &str, text: &str) {
            fs::write(self.path(name), text).unwrap();
        }

        /// Rescans and expects no problem at all.
        fn scan_ok(&mut self) -> bool {
            let outcome = self.src.rescan();
            assert!(
                outcome.errors.is_empty(),
                "unexpected errors: {:#?}",
                outcome.errors
            );
            outcome.changed
        }

        /// Rescans and returns the text of the single problem reported.
        fn scan_err(&mut self) -> String {
            let outcome = self.src.rescan();
            assert_eq!(
                outcome.errors.len(),
                1,
                "expected one error: {:#?}",
                outcome.errors
            );
            outcome.errors[0].to_string()
        }

        fn keys(&self) -> (Vec<String>, Vec<String>) {
            let objects = self.src.objects();
            let show = |keys: Vec<&ObjectKey>| keys.into_iter().map(ToString::to_string).collect();
            (
                show(objects.services.keys().collect()),
                show(objects.slices.keys().collect()),
            )
        }
    }

    fn strs(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn multi_document_yaml() {
        let mut fx = Fixture::new();
        fx.write(
            "web.yaml",
            &format!("# web\n---\n{SERVICE_WEB}---\n{SLICE_WEB}---\n"),
        );
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/web"]), strs(&["shop/web-abc"])));
        let objects = fx.src.objects();
        let service = &objects.services_vec()[0];
        assert_eq!(
            service.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
            80
        );
        assert_eq!(objects.slices_vec()[0].endpoints[0].addresses, ["10.0.0.5"]);
    }

    #[test]
    fn json_file() {
        let mut fx = Fixture::new();
        let json = r#"{"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "db", "namespace": "data"},
            "spec": {"ports": [{"port": 5432}]}}"#;
        fx.write("db.json", json);
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["data/db"]), vec![]));
    }

    #[test]
    fn kind_list() {
        let mut fx = Fixture::new();
        let list = serde_json::json!({
            "apiVersion": "v1", "kind": "List",
            "items": [
                serde_yaml::from_str::<Value>(SERVICE_WEB).unwrap(),
                serde_yaml::from_str::<Value>(SLICE_WEB).unwrap(),
            ],
        });
        fx.write("all.json", &list.to_string());
        fx.write("empty.yaml", "apiVersion: v1\nkind: List\nitems: []\n");
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/web"]), strs(&["shop/web-abc"])));
    }

    #[test]
    fn kubectl_output_with_managed_fields_and_status() {
        let mut fx = Fixture::new();
        fx.write("dump.yaml", KUBECTL_OUTPUT);
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/api"]), strs(&["shop/api-x7k2p"])));
        let slice = &fx.src.objects().slices_vec()[0];
        assert_eq!(slice.endpoints[0].node_name.as_deref(), Some("node-a"));
    }

    #[test]
    fn unknown_kinds_ignored() {
        let mut fx = Fixture::new();
        let deployment =
            "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\nspec: {replicas: 1}\n";
        let endpoints = "apiVersion: v1\nkind: Endpoints\nmetadata:\n  name: web\n";
        fx.write(
            "app.yaml",
            &format!("{deployment}---\n{endpoints}---\n{SERVICE_WEB}"),
        );
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/web"]), vec![]));
    }

    #[test]
    fn nodes_are_read_by_name_for_the_pod_network() {
        let mut fx = Fixture::new();
        let node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\nspec:\n  podCIDRs: [10.244.1.0/24]\nstatus:\n  addresses:\n  - {type: InternalIP, address: 192.168.0.1}\n";
        fx.write("nodes.yaml", &format!("{node}---\n{SERVICE_WEB}"));
        assert!(fx.scan_ok());
        let objects = fx.src.objects();
        assert_eq!(objects.nodes.keys().collect::<Vec<_>>(), ["n1"]);
        assert_eq!(objects.nodes["n1"].metadata.namespace, None);
        assert_eq!(fx.keys(), (strs(&["shop/web"]), vec![]));
        // A Node without a name is an error like any object's.
        fx.write("nodes.yaml", "apiVersion: v1\nkind: Node\nmetadata: {}\n");
        assert!(fx.scan_err().contains("metadata.name is missing"));
    }

    #[test]
    fn default_namespace() {
        let mut fx = Fixture::new();
        fx.write("web.yml", &SERVICE_WEB.replace("  namespace: shop\n", ""));
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["default/web"]), vec![]));
        let service = &fx.src.objects().services_vec()[0];
        assert_eq!(service.metadata.namespace.as_deref(), Some("default"));
    }

    #[test]
    fn invalid_yaml_reports_file_line_and_column() {
        let mut fx = Fixture::new();
        // The second document is broken on the `:` after `bad name` (line 4 of the document).
        let broken = "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad name: here\n";
        fx.write("web.yaml", &format!("{SERVICE_WEB}---\n{broken}"));
        let err = fx.scan_err();
        let line = SERVICE_WEB.lines().count() + 1 + 4;
        let expected = format!(
            "{}:{line}:17: invalid YAML: mapping values are not allowed",
            fx.path("web.yaml").display()
        );
        assert!(err.starts_with(&expected), "{err}");
        assert!(
            err.ends_with("; fix the file, its previous objects stay programmed"),
            "{err}"
        );
        assert!(
            !err.contains(" at line "),
            "relative positions must be stripped: {err}"
        );
        assert!(
            fx.keys().0.is_empty(),
            "a broken file programs nothing of its new content"
        );
    }

    #[test]
    fn invalid_json_reports_file_line_and_column() {
        let mut fx = Fixture::new();
        fx.write(
            "db.json",
            "{\n  \"kind\": \"Service\",\n  \"apiVersion\" \"v1\"\n}\n",
        );
        let err = fx.scan_err();
        let expected = format!(
            "{}:3:16: invalid JSON: expected `:`;",
            fx.path("db.json").display()
        );
        assert!(err.starts_with(&expected), "{err}");
    }

    #[test]
    fn deserialize_error_reports_document_start_line() {
        let mut fx = Fixture::new();
        let bad = SLICE_WEB.replace("- port: 8080", "- port: eighty");
        fx.write(
            "web.yaml",
            &format!("{SERVICE_WEB}\n# the slice\n---\n{bad}"),
        );
        let err = fx.scan_err();
        let line = SERVICE_WEB.lines().count() + 4;
        let expected = format!(
            "{}:{line}: EndpointSlice shop/web-abc: invalid type: string \"eighty\", expected i32;",
            fx.path("web.yaml").display()
        );
        assert!(err.starts_with(&expected), "{err}");
    }

    #[test]
    fn wrong_api_version_is_an_error() {
        let mut fx = Fixture::new();
        fx.write(
            "web.yaml",
            &SLICE_WEB.replace("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"),
        );
        let err = fx.scan_err();
        assert!(
            err.contains(":1: EndpointSlice shop/web-abc: apiVersion discovery.k8s.io/v1beta1 is not supported, use apiVersion: discovery.k8s.io/v1;"),
            "{err}"
        );
    }

    #[test]
    fn missing_name_is_an_error() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", &SERVICE_WEB.replace("  name: web\n", ""));
        let err = fx.scan_err();
        assert!(
            err.contains(":1: Service: metadata.name is missing;"),
            "{err}"
        );
    }

    #[test]
    fn list_item_errors_name_the_item() {
        let mut fx = Fixture::new();
        fx.write(
            "dump.yaml",
            &KUBECTL_OUTPUT.replace("    port: 8080", "    port: []"),
        );
        let err = fx.scan_err();
        assert!(
            err.contains(":1: items[1]: EndpointSlice shop/api-x7k2p: invalid type: sequence"),
            "{err}"
        );
    }

    #[test]
    fn broken_edit_keeps_last_good_state_until_fixed() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", &format!("{SERVICE_WEB}---\n{SLICE_WEB}"));
        assert!(fx.scan_ok());
        let good = fx.src.objects();

        // The Service is renamed but the slice document is broken: nothing of it applies.
        let renamed = SERVICE_WEB.replace("name: web", "name: www");
        fx.write(
            "web.yaml",
            &format!("{renamed}---\n{SLICE_WEB}  - oops: [\n"),
        );
        let outcome = fx.src.rescan();
        assert!(!outcome.changed);
        assert_eq!(outcome.errors.len(), 1);
        assert_eq!(fx.src.objects(), good);
        // Unchanged broken content keeps being reported, without being parsed again.
        let parses = fx.src.parses;
        assert_eq!(fx.src.rescan().errors, outcome.errors);
        assert_eq!(fx.src.parses, parses);

        fx.write("web.yaml", &format!("{renamed}---\n{SLICE_WEB}"));
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/www"]), strs(&["shop/web-abc"])));
    }

    #[test]
    fn removed_file_drops_its_objects() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", SERVICE_WEB);
        fx.write("slice.yaml", SLICE_WEB);
        assert!(fx.scan_ok());
        fs::remove_file(fx.path("web.yaml")).unwrap();
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (vec![], strs(&["shop/web-abc"])));
    }

    #[test]
    fn removed_broken_file_drops_its_objects_and_errors() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", SERVICE_WEB);
        assert!(fx.scan_ok());
        fx.write("web.yaml", "kind: [\n");
        fx.scan_err();
        fs::remove_file(fx.path("web.yaml")).unwrap();
        assert!(fx.scan_ok());
        assert!(fx.src.objects().is_empty());
    }

    #[test]
    fn failing_files_counts_files_not_warnings() {
        let mut fx = Fixture::new();
        fx.write("a.yaml", SERVICE_WEB);
        fx.write("b.yaml", SERVICE_WEB);
        fx.write("bad.yaml", "kind: [\n");
        let broken = "apiVersion: v1\nkind: Service\n---\n- a list\n---\n- another\n";
        fx.write("two.yaml", broken);
        let outcome = fx.src.rescan();
        assert_eq!(outcome.errors.len(), 5, "{:#?}", outcome.errors);
        assert_eq!(failing_files(&outcome.errors), 2, "{:#?}", outcome.errors);
    }

    #[test]
    fn duplicate_object_across_files_reported_last_wins() {
        let mut fx = Fixture::new();
        fx.write("a.yaml", SERVICE_WEB);
        fx.write(
            "b.yaml",
            &format!(
                "{SLICE_WEB}---\n{}",
                SERVICE_WEB.replace("port: 80", "port: 81")
            ),
        );
        let outcome = fx.src.rescan();
        assert!(outcome.changed);
        assert_eq!(outcome.errors.len(), 1);
        assert!(outcome.errors[0].is_warning());
        let line = SLICE_WEB.lines().count() + 2;
        let expected = format!(
            "{}:{line}: Service shop/web is also defined at {}:1; the one read last (in path order) is used, remove the other",
            fx.path("b.yaml").display(),
            fx.path("a.yaml").display()
        );
        assert_eq!(outcome.errors[0].to_string(), expected);
        let service = &fx.src.objects().services_vec()[0];
        assert_eq!(
            service.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
            81
        );
        // Same kind and name but another kind of object is no duplicate.
        assert_eq!(fx.keys().1, strs(&["shop/web-abc"]));
    }

    #[test]
    fn unchanged_rescan_reports_no_change() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", SERVICE_WEB);
        assert!(fx.scan_ok());
        let parses = fx.src.parses;
        assert!(!fx.scan_ok());
        // Rewriting the same bytes moves the mtime but the hash saves a parse.
        fx.write("web.yaml", SERVICE_WEB);
        assert!(!fx.scan_ok());
        assert_eq!(fx.src.parses, parses);
        // A new file of objects already known changes nothing either (but is parsed).
        fx.write("other.yaml", "# nothing yet\n");
        assert!(!fx.scan_ok());
        assert_eq!(fx.src.parses, parses + 1);
    }

    #[test]
    fn settled_files_are_not_read_again() {
        let mut fx = Fixture::new();
        fx.write("web.yaml", SERVICE_WEB);
        let old = SystemTime::now() - Duration::from_secs(3600);
        fs::File::options()
            .write(true)
            .open(fx.path("web.yaml"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(fx.scan_ok());
        let read_at = fx
            .src
            .files
            .values()
            .next()
            .unwrap()
            .seen
            .as_ref()
            .unwrap()
            .read_at;
        assert!(!fx.scan_ok());
        let seen = fx.src.files.values().next().unwrap().seen.as_ref().unwrap();
        assert_eq!(
            seen.read_at, read_at,
            "the stamp proved the content unchanged"
        );
    }

    #[test]
    fn ignores_hidden_temp_and_other_files() {
        let mut fx = Fixture::new();
        for name in [
            ".web.yaml",
            ".web.yaml.swp",
            "web.yaml~",
            ".#web.yaml",
            "README.md",
            "web.yaml.bak",
        ] {
            fx.write(name, "not: [valid\n");
        }
        fs::create_dir(fx.path("sub.yaml")).unwrap();
        fs::write(fx.path("sub.yaml/web.yaml"), SERVICE_WEB).unwrap();
        fx.write("WEB.YAML", SERVICE_WEB);
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/web"]), vec![]));
    }

    #[test]
    fn symlinked_files_are_followed() {
        let mut fx = Fixture::new();
        fs::create_dir(fx.path("..data")).unwrap();
        fs::write(fx.path("..data/web.yaml"), SERVICE_WEB).unwrap();
        std::os::unix::fs::symlink("..data/web.yaml", fx.path("web.yaml")).unwrap();
        std::os::unix::fs::symlink("..data/gone.yaml", fx.path("dangling.yaml")).unwrap();
        assert!(fx.scan_ok());
        assert_eq!(fx.keys(), (strs(&["shop/web"]), vec![]));
    }

    #[test]
    fn missing_dir_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = check_dir(&missing).unwrap_err();
        let expected = format!(
            "{}: cannot read the manifests directory: it does not exist; create it or pass an existing directory to --manifests",
            missing.display()
        );
        assert_eq!(err.to_string(), expected);
        let file = dir.path().join("file.yaml");
        fs::write(&file, "").unwrap();
        assert!(
            check_dir(&file)
                .unwrap_err()
                .to_string()
                .contains("it is not a directory")
        );
        assert_eq!(check_dir(dir.path()), Ok(()));

        // A directory vanishing at run time keeps the objects already read.
        let mut src = ManifestsSource::new(missing.clone());
        fs::create_dir(&missing).unwrap();
        fs::write(missing.join("web.yaml"), SERVICE_WEB).unwrap();
        assert!(src.rescan().changed);
        fs::remove_dir_all(&missing).unwrap();
        let outcome = src.rescan();
        assert!(!outcome.changed);
        assert_eq!(outcome.errors, [err]);
        assert_eq!(src.objects().services.len(), 1);
    }

    #[test]
    fn empty_and_comment_only_files_hold_nothing() {
        let mut fx = Fixture::new();
        fx.write("empty.yaml", "");
        fx.write(
            "comments.yaml",
            "# nothing\n---\n# still nothing\n---\n...\n",
        );
        fx.write("empty.json", "\n");
        assert!(!fx.scan_ok());
    }

    #[test]
    fn not_a_mapping_and_missing_kind_are_errors() {
        let mut fx = Fixture::new();
        fx.write("a.yaml", "- just\n- a list\n");
        assert!(
            fx.scan_err()
                .contains(":1: document: expected a mapping with apiVersion and kind;")
        );
        fx.write("a.yaml", "apiVersion: v1\nmetadata: {name: web}\n");
        assert!(fx.scan_err().contains(":1: object default/web: no `kind`;"));
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let mut fx = Fixture::new();
        fs::write(fx.path("web.yaml"), b"kind: Service\nname: \xff\n").unwrap();
        let err = fx.scan_err();
        assert!(err.contains("web.yaml:2:7: invalid UTF-8"), "{err}");
    }

    #[test]
    fn split_yaml_finds_document_lines() {
        let text = "# head\n---\na: 1\n--- # second\n\nb: 2\n---x: 3\n--- {c: 4}\n";
        let chunks = split_yaml(text);
        let lines: Vec<_> = chunks
            .iter()
            .map(|c| (c.first_line, c.content_line))
            .collect();
        assert_eq!(lines, [(1, None), (2, Some(3)), (4, Some(6)), (8, Some(8))]);
        assert_eq!(chunks[2].text, "--- # second\n\nb: 2\n---x: 3\n");
    }

    #[test]
    fn strip_positions_keeps_the_words() {
        let message = "did not find expected key at line 5 column 1, while parsing a block mapping at line 2 column 3";
        assert_eq!(
            strip_positions(message),
            "did not find expected key, while parsing a block mapping"
        );
        assert_eq!(strip_positions("bad at position 0"), "bad");
        assert_eq!(strip_positions("look at line up"), "look at line up");
    }

    #[test]
    fn report_logs_each_problem_once() {
        let err = |line| ManifestError::Syntax {
            at: Position::new(Path::new("/m/web.yaml"), line, None),
            format: "YAML",
            message: "bad".to_owned(),
        };
        let mut reported = HashSet::new();
        assert_eq!(report(&mut reported, &[err(1), err(1)]), 1);
        assert_eq!(report(&mut reported, &[err(1)]), 0);
        assert_eq!(report(&mut reported, &[err(2)]), 1, "a new text is logged");
        assert_eq!(report(&mut reported, &[]), 0);
        assert_eq!(
            report(&mut reported, &[err(2)]),
            1,
            "a problem back after a fix is logged"
        );
    }

    #[tokio::test]
    async fn watch_sends_changes() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let src = ManifestsSource::new(dir.path().to_owned());
        let task = tokio::spawn(watch(src, Duration::from_millis(10), tx));
        fs::write(dir.path().join("web.yaml"), SERVICE_WEB).unwrap();
        let update = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(&update.events[..], [SourceEvent::ServiceApplied(s)] if &*s.name == "web"),
            "{update:?}"
        );

        fs::remove_file(dir.path().join("web.yaml")).unwrap();
        let update = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(&update.events[..], [SourceEvent::ServiceDeleted(k)] if &*k.name == "web"),
            "{update:?}"
        );

        drop(rx);
        fs::write(dir.path().join("web.yaml"), SERVICE_WEB).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }
}
