//! MetaCLIP's balancing (Xu et al. 2023): captions are matched against a list of metadata entries
//! (WordNet synsets, Wikipedia titles, ...) as substrings; each entry's matches are counted over
//! the whole pool; a caption is then kept when any of its matched entries is drawn, entry e with
//! probability min(1, t / count(e)). Head entries ("photo", "the") are thinned to about t samples
//! each, tail entries kept whole, and captions matching nothing are dropped.
//!
//! As MetaCLIP's own `substr_matching` does, the caption is padded with spaces and the
//! punctuation `, . ; : ? ! `` ` is spaced out, and each entry must match between spaces (case as
//! written). The draws are seeded by the sample's key and the entry, so a build gives the same
//! result in any order and on any number of threads. Matching uses the `aho-corasick` crate.

use aho_corasick::{AhoCorasick, MatchKind};
use anyhow::{bail, Context, Result};

use crate::util::rng::{hash_str, mix64};

/// The metadata entries and their automaton.
pub struct Matcher {
    pub entries: Vec<String>,
    automaton: AhoCorasick,
}

/// A caption as MetaCLIP matches it: padded, punctuation spaced out, tabs and line breaks as spaces.
pub fn spaced(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    out.push(' ');
    for c in text.chars() {
        match c {
            ',' | '.' | ';' | ':' | '?' | '!' | '`' => {
                out.push(' ');
                out.push(c);
                out.push(' ');
            }
            '\t' | '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out.push(' ');
    out
}

impl Matcher {
    /// Entries one per line (UTF-8; empty lines ignored), from `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Matcher> {
        let bytes = std::fs::read(path).with_context(|| format!("reading the metadata file {}", path.display()))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| anyhow::anyhow!("{}: not UTF-8 (at byte {})", path.display(), e.utf8_error().valid_up_to()))?;
        // MetaCLIP publishes its metadata as `metadata.json`, one JSON list of strings; a text
        // file holds one entry a line.
        let entries: Vec<String> = if text.trim_start().starts_with('[') {
            let list: Vec<serde_json::Value> =
                serde_json::from_str(&text).with_context(|| format!("{}: starts like a JSON list but is not one", path.display()))?;
            list.into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    serde_json::Value::String(e) => Ok(e),
                    other => bail!("{}: entry {i} is {other}, not a string", path.display()),
                })
                .collect::<Result<Vec<String>>>()?
                .into_iter()
                .filter(|e| !e.trim().is_empty())
                .collect()
        } else {
            text.lines().map(|l| l.trim_end_matches('\r').to_string()).filter(|l| !l.trim().is_empty()).collect()
        };
        if entries.is_empty() {
            bail!("{} has no metadata entries (one per line)", path.display());
        }
        Matcher::new(entries)
    }

    pub fn new(entries: Vec<String>) -> Result<Matcher> {
        let patterns: Vec<String> = entries.iter().map(|e| format!(" {e} ")).collect();
        // Every occurrence of every entry, overlapping (entries share their padding spaces).
        let automaton = AhoCorasick::builder().match_kind(MatchKind::Standard).build(&patterns).context("building the metadata matcher")?;
        Ok(Matcher { entries, automaton })
    }

    /// The distinct entries a caption matches, in increasing order.
    pub fn matches(&self, caption: &str) -> Vec<u32> {
        let text = spaced(caption);
        let mut ids: Vec<u32> = self.automaton.find_overlapping_iter(&text).map(|m| m.pattern().as_u32()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Whether a sample survives balancing: one seeded draw per matched entry, kept when any draw
/// falls under min(1, t / count).
pub fn keep(key: &str, matched: &[u32], counts: &[u64], t: u64, seed: u64) -> bool {
    matched.iter().any(|&e| {
        let count = counts[e as usize].max(t).max(1);
        let p = t as f64 / count as f64;
        let draw = mix64(seed ^ mix64(hash_str(key) ^ mix64(e as u64 + 1)));
        ((draw >> 11) as f64 / (1u64 << 53) as f64) < p
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_as_metaclip_spaces_them() {
        let m = Matcher::new(vec!["cat".into(), "black cat".into(), "dog".into(), "New York".into()]).unwrap();
        assert_eq!(m.matches("A black cat, sitting."), vec![0, 1]);
        // Inside a word is no match; case is as written; punctuation separates.
        assert_eq!(m.matches("concatenate catalog dogma"), Vec::<u32>::new());
        assert_eq!(m.matches("new york at night"), Vec::<u32>::new());
        assert_eq!(m.matches("Flying to New York!"), vec![3]);
        assert_eq!(m.matches("dog\tcat dog"), vec![0, 2]);
        assert_eq!(spaced("a,b\nc"), " a , b c ");
    }

    /// A head entry of 10,000 samples is thinned to about t; tail entries (count ≤ t) stay whole;
    /// a sample with a tail entry survives whatever its head entries draw.
    #[test]
    fn head_entries_are_thinned_to_t_and_tail_entries_kept() {
        let counts = [10_000u64, 50];
        let t = 500;
        let kept = (0..10_000).filter(|i| keep(&format!("k{i}"), &[0], &counts, t, 7)).count();
        assert!((440..=560).contains(&kept), "{kept}");
        assert!((0..50).all(|i| keep(&format!("k{i}"), &[1], &counts, t, 7)));
        assert!((0..50).all(|i| keep(&format!("k{i}"), &[0, 1], &counts, t, 7)));
        assert!(!keep("k", &[], &counts, t, 7), "a sample matching nothing is dropped");
        // Seeded: the same draws every time, other draws with another seed.
        let a: Vec<bool> = (0..100).map(|i| keep(&format!("k{i}"), &[0], &counts, t, 7)).collect();
        let b: Vec<bool> = (0..100).map(|i| keep(&format!("k{i}"), &[0], &counts, t, 7)).collect();
        let c: Vec<bool> = (0..100).map(|i| keep(&format!("k{i}"), &[0], &counts, t, 8)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    /// MetaCLIP's own `metadata.json` (a JSON list) is read as its entries, not as one entry.
    #[test]
    fn metaclips_json_list_is_read_as_its_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        std::fs::write(&path, r#"["red", "blue sky", "caf\u00e9"]"#).unwrap();
        let m = Matcher::from_file(&path).unwrap();
        assert_eq!(m.entries, vec!["red", "blue sky", "café"]);
        assert_eq!(m.matches("a red car under a blue sky"), vec![0, 1]);
        std::fs::write(&path, r#"["red", 3]"#).unwrap();
        let e = format!("{:#}", Matcher::from_file(&path).err().unwrap());
        assert!(e.contains("entry 1 is 3") && e.contains("metadata.json"), "{e}");
    }
}
