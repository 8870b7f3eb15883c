//! The config's reference, derived from the config types themselves: every field's `--set` path,
//! type, default and meaning. The meanings are the fields' doc comments (via the JSON schema
//! `schemars` derives), so `align config` and the source never disagree.

use serde::Serialize;
use serde_json::Value;

use crate::config::Config;

/// One settable field of the config.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Field {
    /// The dotted path `--set` and the TOML file use (`data.image.image_size`).
    pub path: String,
    /// `integer`, `number`, `boolean`, `string`, `list of number`, or `one of a | b`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The value when the file leaves it out; `None` where a preset decides (the towers'
    /// size overrides).
    pub default: Option<Value>,
    /// The value in the config being described, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<Value>,
    /// Where the described config's value came from: `default`, `file`, `--set`, or `start`
    /// (adopted from `model.init`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The field's doc comment.
    pub description: String,
    /// For a field with named values: each value and what it means.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<Choice>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Choice {
    pub value: String,
    pub description: String,
}

/// A section of the config (`[data.image]`) and what it holds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Section {
    pub path: String,
    pub description: String,
}

/// Every field of the config, section by section, and the sections that group them. `of` supplies
/// the values shown beside the defaults.
pub fn reference(of: Option<&Config>) -> (Vec<Section>, Vec<Field>) {
    let schema = schemars::schema_for!(Config);
    let root = schema.as_value();
    let defaults = serde_json::to_value(Config::default()).unwrap_or(Value::Null);
    let values = of.and_then(|c| serde_json::to_value(c).ok());
    let mut walk = Walk { root, defaults: &defaults, values: values.as_ref(), sections: Vec::new(), fields: Vec::new() };
    walk.object(root, "");
    (walk.sections, walk.fields)
}

struct Walk<'a> {
    root: &'a Value,
    defaults: &'a Value,
    values: Option<&'a Value>,
    sections: Vec<Section>,
    fields: Vec<Field>,
}

impl<'a> Walk<'a> {
    fn object(&mut self, schema: &'a Value, prefix: &str) {
        let Some(props) = schema.get("properties").and_then(Value::as_object) else { return };
        // A section's own fields (in name order) come before its subsections, so that each
        // section reads as one block.
        let (subsections, leaves): (Vec<_>, Vec<_>) = props.iter().partition(|(_, p)| self.resolve(p).get("properties").is_some());
        for (name, prop) in leaves.into_iter().chain(subsections) {
            let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
            let target = self.resolve(prop);
            let description = describe(prop).or_else(|| describe(target)).unwrap_or_default();
            if target.get("properties").is_some() {
                self.sections.push(Section { path: path.clone(), description });
                self.object(target, &path);
                continue;
            }
            self.fields.push(Field {
                kind: self.kind(prop),
                default: lookup(self.defaults, &path).filter(|v| !v.is_null()),
                value: self.values.and_then(|v| lookup(v, &path)).filter(|v| !v.is_null()),
                choices: choices(target),
                source: None,
                description,
                path,
            });
        }
    }

    /// The schema a property stands for: its `$ref` followed, an `Option`'s null alternative
    /// dropped.
    fn resolve(&self, schema: &'a Value) -> &'a Value {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            let name = r.rsplit('/').next().unwrap_or_default();
            if let Some(def) = self.root.get("$defs").and_then(|d| d.get(name)) {
                return self.resolve(def);
            }
        }
        if let Some(alts) = schema.get("anyOf").and_then(Value::as_array) {
            if let Some(one) = alts.iter().find(|a| a.get("type").and_then(Value::as_str) != Some("null")) {
                return self.resolve(one);
            }
        }
        schema
    }

    fn kind(&self, prop: &'a Value) -> String {
        let target = self.resolve(prop);
        let named = choices(target);
        if !named.is_empty() {
            return format!("one of {}", named.iter().map(|c| c.value.as_str()).collect::<Vec<_>>().join(" | "));
        }
        let types: Vec<&str> = match target.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect(),
            _ => Vec::new(),
        };
        match types.first().copied() {
            Some("array") => match target.get("items") {
                Some(items) => format!("list of {}", self.kind(items)),
                None => "list".into(),
            },
            Some(t) => t.to_string(),
            None => "value".into(),
        }
    }
}

fn describe(schema: &Value) -> Option<String> {
    schema.get("description").and_then(Value::as_str).map(|d| d.trim().to_string()).filter(|d| !d.is_empty())
}

/// The named values of an enum's schema: `oneOf` constants (documented variants) or `enum`.
fn choices(schema: &Value) -> Vec<Choice> {
    if let Some(alts) = schema.get("oneOf").and_then(Value::as_array) {
        return alts
            .iter()
            .filter_map(|a| {
                let value = a.get("const").or_else(|| a.get("enum").and_then(|e| e.get(0)))?.as_str()?.to_string();
                Some(Choice { value, description: describe(a).unwrap_or_default() })
            })
            .collect();
    }
    match schema.get("enum").and_then(Value::as_array) {
        Some(values) => values.iter().filter_map(Value::as_str).map(|v| Choice { value: v.into(), description: String::new() }).collect(),
        None => Vec::new(),
    }
}

fn lookup(v: &Value, path: &str) -> Option<Value> {
    path.split('.').try_fold(v, |v, k| v.get(k)).cloned()
}

/// A value as the TOML file writes it (`"cosine"`, `1e-3`, `[0.5, 0.5, 0.5]`).
pub fn toml_text(v: &Value) -> String {
    match toml::Value::try_from(v) {
        Ok(t) => t.to_string(),
        Err(_) => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field<'a>(fields: &'a [Field], path: &str) -> &'a Field {
        fields.iter().find(|f| f.path == path).unwrap_or_else(|| panic!("{path} missing"))
    }

    /// Every leaf of the default config as the TOML file writes it is a documented field, and
    /// every documented field is a `--set` path the config accepts with its default.
    #[test]
    fn every_field_is_listed_documented_and_settable() {
        let (sections, fields) = reference(None);
        let toml = toml::Value::try_from(Config::default()).unwrap();
        let mut leaves = Vec::new();
        fn collect(v: &toml::Value, prefix: &str, out: &mut Vec<String>) {
            match v {
                toml::Value::Table(t) => {
                    for (k, v) in t {
                        collect(v, &if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, out);
                    }
                }
                _ => out.push(prefix.to_string()),
            }
        }
        collect(&toml, "", &mut leaves);
        let paths: Vec<&str> = fields.iter().map(|f| f.path.as_str()).collect();
        for leaf in &leaves {
            assert!(paths.contains(&leaf.as_str()), "{leaf} is in the config but not in the reference");
        }
        // The towers' overrides have no default (the preset decides), nor has a NaFlex patch
        // budget (a SigLIP 2 start brings it), so they are not in the default TOML; everything
        // else is.
        for f in &fields {
            assert!(!f.description.is_empty(), "{} has no doc comment", f.path);
            assert!(
                f.default.is_some()
                    || f.path.starts_with("model.vit.")
                    || f.path.starts_with("model.efficientnet.")
                    || f.path.starts_with("model.bert.")
                    || f.path.starts_with("data.image.naflex."),
                "{} has no default",
                f.path
            );
            if let Some(d) = &f.default {
                let set = format!("{}={}", f.path, toml_text(d));
                Config::from_str_with_overrides("", "test", std::slice::from_ref(&set)).unwrap_or_else(|e| panic!("--set {set}: {e:#}"));
            }
        }
        for s in &sections {
            assert!(!s.description.is_empty(), "section {} has no description", s.path);
        }
        assert!(fields.len() > 100, "only {} fields", fields.len());
    }

    #[test]
    fn fields_carry_type_default_value_and_choices() {
        let mut cfg = Config::default();
        cfg.train.lr = 5e-4;
        let (_, fields) = reference(Some(&cfg));
        let lr = field(&fields, "train.lr");
        assert_eq!((lr.kind.as_str(), lr.default.clone(), lr.value.clone()), ("number", Some(1e-3.into()), Some(5e-4.into())));
        assert!(lr.description.contains("Peak learning rate"), "{}", lr.description);
        let schedule = field(&fields, "train.schedule");
        assert_eq!(schedule.kind, "one of linear | cosine | constant");
        assert!(schedule.choices[1].description.contains("cosine"), "{:?}", schedule.choices);
        assert_eq!(field(&fields, "data.image.mean").kind, "list of number");
        assert_eq!(field(&fields, "train.steps").kind, "integer");
        assert_eq!(field(&fields, "data.image.image_size").default, Some(289.into()));
        let patch = field(&fields, "model.vit.patch_size");
        assert_eq!((patch.kind.as_str(), patch.default.clone()), ("integer", None));
        assert_eq!(toml_text(&serde_json::json!([0.5, 0.5])), "[0.5, 0.5]");
        assert_eq!(toml_text(&serde_json::json!("cosine")), "\"cosine\"");
    }
}
