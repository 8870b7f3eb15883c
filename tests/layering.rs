//! The import graph of `src/`, read from the code: no two files use each other, and each folder
//! uses only the folders ARCHITECTURE.md's table allows. Test modules are left out (a test may
//! reach further than the code it tests), and so is a parent module's re-export of its own
//! children (`pub use child::Item` presents the child; it is not a dependency of the parent).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file (`io/format/hf/files.rs` → `io::format::hf::files`; `mod.rs` is its
/// folder; `lib.rs` and `main.rs` the root).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The file holding module `path`, or the nearest enclosing module's (an item's path names the
/// module it lives in).
fn file_of(files: &BTreeSet<PathBuf>, path: &[String]) -> PathBuf {
    for n in (1..=path.len()).rev() {
        let dir: PathBuf = path[..n].iter().collect();
        for candidate in [dir.with_extension("rs"), dir.join("mod.rs")] {
            if files.contains(&candidate) {
                return candidate;
            }
        }
    }
    PathBuf::from("lib.rs")
}

/// The code of a file without comments, string literals and its test module.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut kept = String::new();
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if !in_str && c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' && !(prev == '\'' && chars.get(i + 1) == Some(&'\'')) {
                in_str = !in_str;
            } else if !in_str {
                kept.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
            i += 1;
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// Expands the use-tree starting at `rest` (after `prefix::`) into whole paths.
fn expand(prefix: &[String], rest: &str, out: &mut Vec<Vec<String>>) {
    let rest = rest.trim_start();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(prefix, &inner[start..i], out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(prefix, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let mut path = prefix.to_vec();
    let mut rest = rest;
    loop {
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        path.push(rest[..end].to_string());
        rest = &rest[end..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with('{') => return expand(&path, r, out),
            Some(r) => rest = r,
            None => break,
        }
    }
    if path.len() > prefix.len() {
        out.push(path);
    }
}

/// Every module path a file's code names: `crate::`, `align::`, `super::` and `self::` paths,
/// and `use child::...` of a module it declares. A parent's `pub use` of its children is left
/// out.
fn references(module: &[String], code: &str) -> Vec<Vec<String>> {
    let children: BTreeSet<String> = code
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("pub(crate) ").or_else(|| l.strip_prefix("pub ")).unwrap_or(l);
            l.strip_prefix("mod ").map(|r| r.trim_end_matches(';').trim().to_string())
        })
        .collect();
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        let rest = &code[i..];
        let root = ["crate::", "align::", "super::", "self::"].into_iter().find(|r| rest.starts_with(r));
        let (Some(root), true) = (root, boundary) else {
            // `use child::...` and `pub use child::...`: the first names a child's items for use
            // here, the second re-exports them.
            if boundary && rest.starts_with("use ") {
                let line_start = code[..i].rfind('\n').map_or(0, |p| p + 1);
                let reexport = code[line_start..i].trim_start().starts_with("pub");
                let after = &rest[4..];
                if let Some(first) = after.split("::").next().filter(|f| children.contains(*f)) {
                    if !reexport {
                        let mut base = module.to_vec();
                        base.push(first.to_string());
                        expand(&base, &after[first.len() + 2..], &mut out);
                    }
                }
            }
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        let mut base = match root {
            "crate::" | "align::" => Vec::new(),
            "self::" => module.to_vec(),
            _ => module[..module.len().saturating_sub(1)].to_vec(),
        };
        let mut after = &rest[root.len()..];
        while let Some(r) = after.strip_prefix("super::") {
            base.pop();
            after = r;
        }
        let line_start = code[..i].rfind('\n').map_or(0, |p| p + 1);
        let reexport = code[line_start..i].trim_start().starts_with("pub use self::");
        if !reexport {
            expand(&base, after, &mut out);
        }
        i += root.len();
    }
    out
}

/// Which folder of ARCHITECTURE.md's table a file is in.
fn folder(rel: &Path) -> String {
    let first = rel.iter().next().unwrap().to_string_lossy().into_owned();
    match first.as_str() {
        "config.rs" | "config_reference.rs" => "config".into(),
        "main.rs" => "cli".into(),
        other => other.to_string(),
    }
}

/// ARCHITECTURE.md's "What may import what".
fn allowed() -> BTreeMap<&'static str, Vec<&'static str>> {
    BTreeMap::from([
        ("util", vec![]),
        ("ops", vec!["util"]),
        ("data", vec!["util"]),
        ("model", vec!["ops", "util"]),
        ("config", vec!["model", "data", "util"]),
        ("io", vec!["config", "model", "data", "util"]),
        ("eval", vec!["io", "config", "model", "data", "util"]),
        ("train", vec!["eval", "io", "config", "model", "ops", "data", "util"]),
        ("plot", vec!["io", "util"]),
    ])
}

struct Graph {
    /// file → files it uses, with the first path that made each edge.
    edges: BTreeMap<PathBuf, BTreeMap<PathBuf, String>>,
}

fn graph() -> Graph {
    let root = src();
    let mut paths = Vec::new();
    rust_files(&root, &mut paths);
    let files: BTreeSet<PathBuf> = paths.iter().map(|p| p.strip_prefix(&root).unwrap().to_path_buf()).collect();
    let mut edges = BTreeMap::new();
    for rel in &files {
        let code = code_of(&std::fs::read_to_string(root.join(rel)).unwrap());
        let module = module_of(rel);
        let mut uses = BTreeMap::new();
        for path in references(&module, &code) {
            let target = file_of(&files, &path);
            if &target != rel && target != Path::new("lib.rs") {
                uses.entry(target).or_insert_with(|| path.join("::"));
            }
        }
        edges.insert(rel.clone(), uses);
    }
    Graph { edges }
}

#[test]
fn no_two_files_use_each_other() {
    let g = graph();
    let mut pairs = Vec::new();
    for (a, uses) in &g.edges {
        for (b, why) in uses {
            if a < b {
                if let Some(back) = g.edges.get(b).and_then(|u| u.get(a)) {
                    pairs.push(format!("{} ({why}) <-> {} ({back})", a.display(), b.display()));
                }
            }
        }
    }
    assert!(pairs.is_empty(), "files that use each other:\n  {}", pairs.join("\n  "));
}

#[test]
fn each_folder_uses_only_the_folders_below_it() {
    let g = graph();
    let allowed = allowed();
    let mut wrong = Vec::new();
    for (a, uses) in &g.edges {
        let from = folder(a);
        let Some(may) = allowed.get(from.as_str()) else { continue };
        for (b, why) in uses {
            let to = folder(b);
            if to != from && !may.contains(&to.as_str()) {
                wrong.push(format!("{} uses {} ({why})", a.display(), b.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "imports against ARCHITECTURE.md's table:\n  {}", wrong.join("\n  "));
}

/// The reader itself: it sees what it must, so that the two tests above can fail.
#[test]
fn the_reader_finds_uses_of_every_form() {
    let module: Vec<String> = ["io", "registry", "resolve"].iter().map(|s| s.to_string()).collect();
    let code = code_of(
        "use super::formats::{read_list, FORMATS};\nuse crate::io::{format::{hf::files, Format}, tensors};\n// crate::train::x\nlet s = \"crate::eval::y\";\nlet d = crate::io::run_dir::LATEST;\nmod inner;\nuse inner::X;\npub use inner::Y;\n",
    );
    let found: BTreeSet<String> = references(&module, &code).into_iter().map(|p| p.join("::")).collect();
    let want = [
        "io::registry::formats::read_list",
        "io::registry::formats::FORMATS",
        "io::format::hf::files",
        "io::format::Format",
        "io::tensors",
        "io::run_dir::LATEST",
        "io::registry::resolve::inner::X",
    ];
    assert_eq!(found, want.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>());
}
