//! Where each object of the manifests source is defined, so that a changed file updates
//! the merged view through the keys it touches instead of a merge of every file.
//!
//! An object (kind and `namespace/name`) may be defined in several files, or twice in
//! one: the definition read last in path order wins, and every other one is reported as
//! a duplicate. [`DefIndex`] keeps each key's definitions in that order and remembers
//! which keys changed since the last [`DefIndex::take_touched`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::store::ObjectKey;

/// An object's kind (`"Service"`, `"EndpointSlice"`, `"Node"`) and key.
pub(super) type DefKey = (&'static str, ObjectKey);

/// One definition of an object: the file, the line its document starts on, and its
/// position among the objects of that file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Def {
    pub(super) path: Arc<Path>,
    pub(super) line: usize,
    pub(super) index: usize,
}

impl Def {
    fn order(&self) -> (&Path, usize) {
        (&self.path, self.index)
    }
}

/// A duplicate definition: `at` redefines what `first` (the definition before it in
/// path order) defined.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Duplicate<'a> {
    pub(super) key: &'a DefKey,
    pub(super) at: &'a Def,
    pub(super) first: &'a Def,
}

#[derive(Debug, Default)]
pub(super) struct DefIndex {
    /// Each key's definitions, in (path, index) order: the last one wins.
    defs: HashMap<DefKey, Vec<Def>>,
    /// Keys with more than one definition.
    multiple: BTreeSet<DefKey>,
    /// Keys whose definitions changed since the last [`DefIndex::take_touched`].
    touched: HashSet<DefKey>,
}

impl DefIndex {
    /// Records the objects of `path` (key, line, in file order).
    pub(super) fn add_file<'a>(
        &mut self,
        path: &Path,
        objects: impl IntoIterator<Item = (&'static str, &'a ObjectKey, usize)>,
    ) {
        let path: Arc<Path> = Arc::from(path);
        for (index, (kind, key, line)) in objects.into_iter().enumerate() {
            let key = (kind, key.clone());
            let def = Def {
                path: path.clone(),
                line,
                index,
            };
            let defs = self.defs.entry(key.clone()).or_default();
            let at = defs.partition_point(|d| d.order() < def.order());
            defs.insert(at, def);
            if defs.len() > 1 {
                self.multiple.insert(key.clone());
            }
            self.touched.insert(key);
        }
    }

    /// Forgets the definitions `path` holds of these keys (its objects as last added).
    pub(super) fn remove_file<'a>(
        &mut self,
        path: &Path,
        keys: impl IntoIterator<Item = (&'static str, &'a ObjectKey)>,
    ) {
        for (kind, key) in keys {
            let key = (kind, key.clone());
            let Some(defs) = self.defs.get_mut(&key) else {
                continue;
            };
            defs.retain(|d| *d.path != *path);
            match defs.len() {
                0 => {
                    self.defs.remove(&key);
                    self.multiple.remove(&key);
                }
                1 => {
                    self.multiple.remove(&key);
                }
                _ => {}
            }
            self.touched.insert(key);
        }
    }

    /// The keys touched since the last call, each with its winning definition (`None`
    /// when no file defines it any more).
    pub(super) fn take_touched(&mut self) -> Vec<(DefKey, Option<Def>)> {
        let touched = std::mem::take(&mut self.touched);
        touched
            .into_iter()
            .map(|key| {
                let winner = self.defs.get(&key).and_then(|d| d.last()).cloned();
                (key, winner)
            })
            .collect()
    }

    /// Every redefinition, in path order.
    pub(super) fn duplicates(&self) -> Vec<Duplicate<'_>> {
        let mut out: Vec<Duplicate<'_>> = self
            .multiple
            .iter()
            .filter_map(|key| Some((key, self.defs.get(key)?)))
            .flat_map(|(key, defs)| {
                defs.windows(2).map(move |w| Duplicate {
                    key,
                    at: &w[1],
                    first: &w[0],
                })
            })
            .collect();
        out.sort_by(|a, b| a.at.order().cmp(&b.at.order()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("default", name)
    }

    fn winners(index: &mut DefIndex) -> Vec<(String, Option<String>)> {
        let mut out: Vec<(String, Option<String>)> = index
            .take_touched()
            .into_iter()
            .map(|((kind, k), w)| {
                (
                    format!("{kind} {k}"),
                    w.map(|d| format!("{}:{}", d.path.display(), d.line)),
                )
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn the_last_definition_in_path_order_wins_and_the_others_are_duplicates() {
        let mut index = DefIndex::default();
        let (a, b) = (key("a"), key("b"));
        index.add_file(
            Path::new("2.yaml"),
            [("Service", &a, 1), ("EndpointSlice", &a, 5)],
        );
        index.add_file(
            Path::new("1.yaml"),
            [("Service", &a, 3), ("Service", &b, 9)],
        );
        assert_eq!(
            winners(&mut index),
            [
                ("EndpointSlice default/a".into(), Some("2.yaml:5".into())),
                ("Service default/a".into(), Some("2.yaml:1".into())),
                ("Service default/b".into(), Some("1.yaml:9".into())),
            ]
        );
        let dups = index.duplicates();
        assert_eq!(dups.len(), 1, "{dups:?}");
        assert_eq!(
            (dups[0].at.line, dups[0].first.line, &*dups[0].first.path),
            (1, 3, Path::new("1.yaml"))
        );
        assert!(winners(&mut index).is_empty(), "nothing touched since");

        // 2.yaml loses its Service: 1.yaml's definition is the one left.
        index.remove_file(
            Path::new("2.yaml"),
            [("Service", &a), ("EndpointSlice", &a)],
        );
        index.add_file(Path::new("2.yaml"), [("EndpointSlice", &a, 1)]);
        assert_eq!(
            winners(&mut index),
            [
                ("EndpointSlice default/a".into(), Some("2.yaml:1".into())),
                ("Service default/a".into(), Some("1.yaml:3".into())),
            ]
        );
        assert!(index.duplicates().is_empty());
        index.remove_file(Path::new("1.yaml"), [("Service", &a), ("Service", &b)]);
        assert_eq!(
            winners(&mut index),
            [
                ("Service default/a".into(), None),
                ("Service default/b".into(), None),
            ]
        );
    }

    #[test]
    fn twice_in_one_file_the_later_wins() {
        let mut index = DefIndex::default();
        let a = key("a");
        index.add_file(
            Path::new("x.yaml"),
            [("Service", &a, 1), ("Service", &a, 7)],
        );
        assert_eq!(
            winners(&mut index),
            [("Service default/a".into(), Some("x.yaml:7".into()))]
        );
        let dups = index.duplicates();
        assert_eq!((dups[0].at.line, dups[0].first.line), (7, 1));
        index.remove_file(Path::new("x.yaml"), [("Service", &a), ("Service", &a)]);
        assert_eq!(winners(&mut index), [("Service default/a".into(), None)]);
        assert!(index.defs.is_empty() && index.multiple.is_empty());
    }
}
