use std::path::PathBuf;

use align::config::Config;
use align::config_reference::{reference, toml_text, Field};
use std::fmt::Write as _;
use std::io::Write as _;

use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct ConfigArgs {
    /// Only fields whose path starts with this (`train`, `data.image`, `loss.kind`).
    prefix: Option<String>,
    /// Show this config's values beside the defaults (after its `--set` overrides).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a field of `--config`, as `align train --set` does (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE", requires = "config")]
    overrides: Vec<String>,
    /// Print the fields as JSON (path, type, default, value, description, choices).
    #[arg(long)]
    json: bool,
}

/// Width of the wrapped descriptions, indentation included.
const WIDTH: usize = 100;

pub fn run(a: ConfigArgs) -> Result<()> {
    let mut cfg = a.config.as_ref().map(|p| Config::load(p, &a.overrides)).transpose()?;
    // A start's settings are the run's defaults: show them as `align train` will use them.
    let adopted = match cfg.as_mut() {
        Some(c) if !c.model.init.is_empty() => match align::train::start::Start::resolve(c, None).and_then(|s| s.adopt(c)) {
            Ok(done) => done.taken,
            Err(e) => {
                align::util::log::warn(format!("model.init {}: {e:#}; its settings are not shown", c.model.init));
                Vec::new()
            }
        },
        _ => Vec::new(),
    };
    let (sections, mut fields) = reference(cfg.as_ref());
    if let Some(path) = &a.config {
        let file = align::config::read_file(path)?;
        for f in fields.iter_mut() {
            f.source = Some(source(&f.path, &file, &a.overrides, &adopted).to_string());
        }
    }
    let wanted = |path: &str| match &a.prefix {
        Some(p) => path == p || path.starts_with(&format!("{p}.")),
        None => true,
    };
    let fields: Vec<&Field> = fields.iter().filter(|f| wanted(&f.path)).collect();
    if fields.is_empty() {
        bail!("no config field starts with {:?}; `align config` lists them all", a.prefix.unwrap_or_default());
    }
    if a.json {
        let sections: Vec<_> =
            sections.iter().filter(|s| wanted(&s.path) || fields.iter().any(|f| f.path.starts_with(&format!("{}.", s.path)))).collect();
        return super::print_json(&serde_json::json!({"sections": sections, "fields": fields}));
    }
    let mut out = String::new();
    let mut section = String::new();
    for f in fields {
        let parent = f.path.rsplit_once('.').map_or("", |(p, _)| p);
        if parent != section {
            section = parent.to_string();
            writeln!(out, "[{section}]")?;
            if let Some(s) = sections.iter().find(|s| s.path == section) {
                wrap(&mut out, &s.description, 2)?;
            }
            writeln!(out)?;
        }
        let default = f.default.as_ref().map_or("(the preset's)".to_string(), toml_text);
        let shown = match (&f.value, &f.default) {
            (Some(v), d) if Some(v) != d.as_ref() => format!("{} (default {default})", toml_text(v)),
            _ => default,
        };
        let from = f.source.as_deref().filter(|s| *s != "default").map_or(String::new(), |s| format!("  from {s}"));
        writeln!(out, "  {} = {shown}    [{}]{from}", f.path, f.kind)?;
        wrap(&mut out, &f.description, 6)?;
        for c in &f.choices {
            if !c.description.is_empty() {
                wrap(&mut out, &format!("{}: {}", c.value, c.description), 8)?;
            }
        }
        writeln!(out)?;
    }
    // A reader that stops early (`| head`) is not an error.
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Where the value at `path` came from: a `--set` override, the start (`model.init`), the file,
/// or the default. An override names the field or a table above it.
fn source(path: &str, file: &toml::Table, overrides: &[String], adopted: &[String]) -> &'static str {
    let names = |key: &str| path == key || path.starts_with(&format!("{key}."));
    if overrides.iter().filter_map(|o| o.split_once('=')).any(|(k, _)| names(k.trim())) {
        return "--set";
    }
    if adopted.iter().any(|line| line.starts_with(&format!("{path} = "))) {
        return "start";
    }
    // A table given whole in the file (`vit = {patch_size = 8}`) sets the fields it names.
    if align::config::value_at(file, path).is_some() {
        "file"
    } else {
        "default"
    }
}

/// `text` word-wrapped at [`WIDTH`] columns, each line indented by `indent`; the paragraphs of
/// a doc comment stay apart.
fn wrap(out: &mut String, text: &str, indent: usize) -> std::fmt::Result {
    for paragraph in text.split("\n\n") {
        let mut line = String::new();
        for word in paragraph.split_whitespace() {
            if !line.is_empty() && indent + line.chars().count() + 1 + word.chars().count() > WIDTH {
                writeln!(out, "{:indent$}{line}", "")?;
                line.clear();
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        if !line.is_empty() {
            writeln!(out, "{:indent$}{line}", "")?;
        }
    }
    Ok(())
}
