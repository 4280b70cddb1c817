//! Files the container runtime reads: ferry's CNI configuration and the plugin binary,
//! each replaced atomically (written next to its place, synced, renamed over it), so
//! that a runtime never reads half a file, and rewritten only when they differ.

use std::{
    fs,
    io::{self, Write},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

/// Makes `dir/name` hold `content` with `mode`; `Ok(false)` when it already did.
pub fn write_atomic(dir: &Path, name: &str, content: &[u8], mode: u32) -> io::Result<bool> {
    let dest = dir.join(name);
    if fs::read(&dest).is_ok_and(|old| old == content)
        && fs::metadata(&dest).is_ok_and(|m| m.permissions().mode() & 0o7777 == mode)
    {
        return Ok(false);
    }
    fs::create_dir_all(dir)?;
    // A dot name, so that the runtime (which reads *.conflist) ignores it meanwhile.
    let tmp = dir.join(format!(".{name}.ferry-tmp"));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(content)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, &dest)?;
        fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| true)
}

/// Removes `dir/name` if it is there; `Ok(false)` when it was not.
pub fn remove(dir: &Path, name: &str) -> io::Result<bool> {
    match fs::remove_file(dir.join(name)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The plugin binary shipped next to the agent's own executable (as in the image).
pub fn default_plugin() -> PathBuf {
    std::env::current_exe()
        .map(|exe| exe.with_file_name(super::plan::PLUGIN_TYPE))
        .unwrap_or_else(|_| PathBuf::from("/usr/local/bin").join(super::plan::PLUGIN_TYPE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_once_and_replaces_on_change() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_atomic(dir.path(), "a.conflist", b"one", 0o644).unwrap());
        assert!(!write_atomic(dir.path(), "a.conflist", b"one", 0o644).unwrap());
        assert!(write_atomic(dir.path(), "a.conflist", b"two", 0o644).unwrap());
        assert_eq!(fs::read(dir.path().join("a.conflist")).unwrap(), b"two");
        // A mode change alone is a change.
        assert!(write_atomic(dir.path(), "a.conflist", b"two", 0o755).unwrap());
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["a.conflist"], "no temporary file is left");
        assert!(remove(dir.path(), "a.conflist").unwrap());
        assert!(!remove(dir.path(), "a.conflist").unwrap());
    }
}
