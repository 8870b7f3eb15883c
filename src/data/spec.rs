//! Shard specifications: turning what a researcher types into a list of shard locations.
//!
//! Accepted forms, combinable:
//! - a local path: `data/cc3m-00001.tar`
//! - brace expansion as Python's `braceexpand` does it: numeric ranges keep zero padding
//!   (`cc12m-{00000..01242}.tar`), comma alternatives (`{train,val}`), several and nested braces
//! - globs after brace expansion: `shards/*.tar` (a glob matching nothing is an error)
//! - several specs joined with `::` (open_clip's convention for mixing datasets)
//! - a list file: a path ending in `.txt` or `.list`, or any path prefixed with `@`, holding one
//!   spec per line (blank lines and `#` comments ignored; relative paths are relative to the file)
//! - `pipe:CMD`: the shard is the standard output of `sh -c CMD` (e.g. `pipe:curl -s URL`), as in
//!   webdataset. Braces inside the command are expanded too.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Where one shard's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShardSource {
    File(PathBuf),
    Pipe(String),
}

impl fmt::Display for ShardSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardSource::File(p) => write!(f, "{}", p.display()),
            ShardSource::Pipe(cmd) => write!(f, "pipe:{cmd}"),
        }
    }
}

#[derive(Debug, Error)]
pub enum SpecError {
    #[error("shard spec {spec:?} matches no shard")]
    NoMatch { spec: String },
    #[error("shard spec {spec:?}: {what}")]
    Malformed { spec: String, what: String },
    #[error("shard list {path}: {source}")]
    ListFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Expands a spec into shard sources, in the order written. Local files must exist.
pub fn expand(spec: &str) -> Result<Vec<ShardSource>, SpecError> {
    expand_in(spec, Path::new(""))
}

fn expand_in(spec: &str, base: &Path) -> Result<Vec<ShardSource>, SpecError> {
    let out: Vec<ShardSource> = expand_parts_in(spec, base)?.into_iter().flatten().collect();
    if out.is_empty() {
        return Err(SpecError::NoMatch { spec: spec.to_string() });
    }
    Ok(out)
}

/// The sources of a spec joined with `::`, each expanded on its own (for weighting sources, as
/// open_clip's `--train-data-upsampling-factors` does).
pub fn expand_parts(spec: &str) -> Result<Vec<Vec<ShardSource>>, SpecError> {
    let parts = expand_parts_in(spec, Path::new(""))?;
    if parts.iter().all(Vec::is_empty) {
        return Err(SpecError::NoMatch { spec: spec.to_string() });
    }
    Ok(parts)
}

/// The number of sources `::` joins in a spec.
pub fn source_count(spec: &str) -> usize {
    spec.split("::").map(str::trim).filter(|p| !p.is_empty()).count()
}

fn expand_parts_in(spec: &str, base: &Path) -> Result<Vec<Vec<ShardSource>>, SpecError> {
    let parts: Vec<&str> = spec.split("::").map(str::trim).collect();
    // `a::::b` or a trailing `::` names a source with nothing in it, which would silently shift
    // every upsampling factor after it onto the wrong source.
    if parts.len() > 1 && parts.iter().any(|p| p.is_empty()) {
        return Err(SpecError::Malformed { spec: spec.into(), what: "an empty source between `::` separators".into() });
    }
    parts.into_iter().filter(|p| !p.is_empty()).map(|part| expand_one(part, base)).collect()
}

fn expand_one(part: &str, base: &Path) -> Result<Vec<ShardSource>, SpecError> {
    if let Some(cmd) = part.strip_prefix("pipe:") {
        let cmds = brace_expand(cmd).map_err(|what| SpecError::Malformed { spec: part.into(), what })?;
        return Ok(cmds.into_iter().map(ShardSource::Pipe).collect());
    }
    let (is_list, path_text) = match part.strip_prefix('@') {
        Some(rest) => (true, rest),
        None => (part.ends_with(".txt") || part.ends_with(".list"), part),
    };
    let path_text = path_text.strip_prefix("file:").unwrap_or(path_text);
    if is_list {
        return read_list(&resolve(base, path_text));
    }
    let mut out = Vec::new();
    for p in brace_expand(path_text).map_err(|what| SpecError::Malformed { spec: part.into(), what })? {
        let full = resolve(base, &p);
        let text = full.to_string_lossy().to_string();
        if text.contains(['*', '?', '[']) {
            let paths = glob::glob(&text).map_err(|e| SpecError::Malformed { spec: part.into(), what: e.to_string() })?;
            let mut found: Vec<PathBuf> = paths.filter_map(Result::ok).filter(|p| p.is_file()).collect();
            if found.is_empty() {
                return Err(SpecError::NoMatch { spec: part.to_string() });
            }
            found.sort();
            out.extend(found.into_iter().map(ShardSource::File));
        } else if full.is_file() {
            out.push(ShardSource::File(full));
        } else {
            return Err(SpecError::NoMatch { spec: if p == part { part.to_string() } else { format!("{part} (expanded to {p})") } });
        }
    }
    Ok(out)
}

fn resolve(base: &Path, p: &str) -> PathBuf {
    let path = Path::new(p);
    if path.is_absolute() || base.as_os_str().is_empty() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

fn read_list(path: &Path) -> Result<Vec<ShardSource>, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::ListFile { path: path.to_path_buf(), source })?;
    let base = path.parent().unwrap_or(Path::new(""));
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        out.extend(expand_in(line, base)?);
    }
    if out.is_empty() {
        return Err(SpecError::NoMatch { spec: format!("@{}", path.display()) });
    }
    Ok(out)
}

/// Brace expansion: `a{1..3}b` → a1b a2b a3b; `{x,y}` alternatives; nesting and several braces.
/// Numeric ranges keep the width of a zero-padded bound and accept a step (`{0..10..2}`).
pub fn brace_expand(s: &str) -> Result<Vec<String>, String> {
    let Some(open) = find_open_brace(s) else {
        if s.contains('}') {
            return Err(format!("unmatched '}}' in {s:?}"));
        }
        return Ok(vec![s.to_string()]);
    };
    let close = matching_close(s, open).ok_or_else(|| format!("unmatched '{{' in {s:?}"))?;
    let (prefix, body, suffix) = (&s[..open], &s[open + 1..close], &s[close + 1..]);
    let alternatives = match range_items(body)? {
        Some(items) => items,
        None => {
            let parts = split_top_level_commas(body);
            if parts.len() == 1 {
                // Not a brace expression (e.g. a literal "{}"): keep the braces as text.
                let rest = brace_expand(suffix)?;
                let inner = brace_expand(body)?;
                let mut out = Vec::new();
                for i in &inner {
                    for r in &rest {
                        out.push(format!("{prefix}{{{i}}}{r}"));
                    }
                }
                return Ok(out);
            }
            let mut items = Vec::new();
            for p in parts {
                items.extend(brace_expand(p)?);
            }
            items
        }
    };
    let rest = brace_expand(suffix)?;
    let mut out = Vec::with_capacity(alternatives.len() * rest.len());
    for a in &alternatives {
        for r in &rest {
            out.push(format!("{prefix}{a}{r}"));
        }
    }
    Ok(out)
}

fn find_open_brace(s: &str) -> Option<usize> {
    s.find('{')
}

fn matching_close(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

fn split_top_level_commas(body: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts
}

fn range_items(body: &str) -> Result<Option<Vec<String>>, String> {
    let fields: Vec<&str> = body.split("..").collect();
    if !(fields.len() == 2 || fields.len() == 3) || fields.iter().any(|f| f.is_empty()) {
        return Ok(None);
    }
    let numeric = |f: &str| f.trim_start_matches('-').chars().all(|c| c.is_ascii_digit()) && !f.trim_start_matches('-').is_empty();
    if !fields.iter().all(|f| numeric(f)) {
        if fields.len() == 2 && fields.iter().all(|f| f.chars().count() == 1 && f.chars().all(|c| c.is_ascii_alphabetic())) {
            let (a, b) = (fields[0].chars().next().unwrap(), fields[1].chars().next().unwrap());
            let items: Vec<String> = if a <= b { (a..=b).map(String::from).collect() } else { (b..=a).rev().map(String::from).collect() };
            return Ok(Some(items));
        }
        return Ok(None);
    }
    let lo: i64 = fields[0].parse().map_err(|e| format!("bad range start {:?}: {e}", fields[0]))?;
    let hi: i64 = fields[1].parse().map_err(|e| format!("bad range end {:?}: {e}", fields[1]))?;
    let step: i64 = match fields.get(2) {
        Some(s) => s.parse::<i64>().map_err(|e| format!("bad range step {s:?}: {e}"))?.abs().max(1),
        None => 1,
    };
    let padded = |f: &str| f.trim_start_matches('-').len() > 1 && f.trim_start_matches('-').starts_with('0');
    let width = if padded(fields[0]) || padded(fields[1]) { fields[0].len().max(fields[1].len()) } else { 0 };
    let count = (hi - lo).unsigned_abs() / step as u64 + 1;
    if count > 10_000_000 {
        return Err(format!("range {{{body}}} has {count} items"));
    }
    let dir = if hi >= lo { 1 } else { -1 };
    Ok(Some((0..count as i64).map(|k| format!("{:0width$}", lo + dir * k * step, width = width)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_padded_ranges_keep_their_width() {
        assert_eq!(brace_expand("cc-{0008..0011}.tar").unwrap(), vec!["cc-0008.tar", "cc-0009.tar", "cc-0010.tar", "cc-0011.tar"]);
        assert_eq!(brace_expand("{8..11}").unwrap(), vec!["8", "9", "10", "11"]);
        assert_eq!(brace_expand("{0..6..3}").unwrap(), vec!["0", "3", "6"]);
        assert_eq!(brace_expand("{3..1}").unwrap(), vec!["3", "2", "1"]);
    }

    #[test]
    fn several_and_nested_braces_form_the_product_in_order() {
        assert_eq!(brace_expand("{a,b}-{0..1}").unwrap(), vec!["a-0", "a-1", "b-0", "b-1"]);
        assert_eq!(brace_expand("x{a,b{1..2}}y").unwrap(), vec!["xay", "xb1y", "xb2y"]);
        assert_eq!(brace_expand("plain").unwrap(), vec!["plain"]);
    }

    #[test]
    fn unbalanced_braces_are_errors() {
        assert!(brace_expand("a{1..2").is_err());
        assert!(brace_expand("a}b").is_err());
    }

    #[test]
    fn list_files_globs_and_double_colon_combine() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["a-000.tar", "a-001.tar", "b-000.tar"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        std::fs::write(dir.path().join("list.txt"), "# shards\nb-000.tar\n\na-{000..001}.tar\n").unwrap();
        let d = dir.path().display();
        let got = expand(&format!("{d}/a-*.tar::{d}/list.txt::pipe:cat {d}/b-{{000..000}}.tar")).unwrap();
        let want = vec![
            ShardSource::File(dir.path().join("a-000.tar")),
            ShardSource::File(dir.path().join("a-001.tar")),
            ShardSource::File(dir.path().join("b-000.tar")),
            ShardSource::File(dir.path().join("a-000.tar")),
            ShardSource::File(dir.path().join("a-001.tar")),
            ShardSource::Pipe(format!("cat {d}/b-000.tar")),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn a_spec_matching_nothing_names_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("{}/missing-{{0..2}}.tar", dir.path().display());
        let err = expand(&spec).unwrap_err().to_string();
        assert!(err.contains("missing-{0..2}.tar"), "{err}");
        let err = expand(&format!("{}/*.tar", dir.path().display())).unwrap_err().to_string();
        assert!(err.contains("matches no shard"), "{err}");
    }
}
