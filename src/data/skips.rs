//! Counting what a run had to skip, by reason.
//!
//! A long run must never die on one bad sample; it skips it, says so once, and counts it so the
//! final report shows how much of the data was unusable and why.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Reasons a sample (or the rest of a shard) is skipped. Stable strings: they appear in JSON
/// reports and checkpoints.
pub mod reason {
    pub const CORRUPT_IMAGE: &str = "corrupt_image";
    pub const MISSING_IMAGE: &str = "missing_image";
    pub const IMAGE_TOO_LARGE: &str = "image_too_large";
    pub const MISSING_CAPTION: &str = "missing_caption";
    pub const EMPTY_CAPTION: &str = "empty_caption";
    pub const CAPTION_NOT_UTF8: &str = "caption_not_utf8";
    pub const BAD_LABEL: &str = "bad_label";
    pub const BAD_JSON: &str = "bad_json";
    pub const DUPLICATE_FIELD: &str = "duplicate_field";
    /// The sample being read when its shard's stream broke.
    pub const INCOMPLETE_SAMPLE: &str = "incomplete_sample";
    /// A shard whose tar stream ended early or was malformed; the rest of it is lost.
    pub const TRUNCATED_SHARD: &str = "truncated_shard";
    /// A shard that could not be opened at all (missing file, failing `pipe:` command).
    pub const UNREADABLE_SHARD: &str = "unreadable_shard";
    /// Distillation from stored embeddings: none was stored for the sample's key.
    pub const NO_TEACHER_EMBEDDING: &str = "no_teacher_embedding";
    /// Distillation from stored embeddings: the key's were computed on another caption.
    pub const TEACHER_OTHER_CAPTION: &str = "teacher_other_caption";
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SkipCounts(pub BTreeMap<String, u64>);

impl SkipCounts {
    pub fn add(&mut self, reason: &str) {
        *self.0.entry(reason.to_string()).or_default() += 1;
    }

    pub fn merge(&mut self, other: &SkipCounts) {
        for (k, v) in &other.0 {
            *self.0.entry(k.clone()).or_default() += v;
        }
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    pub fn get(&self, reason: &str) -> u64 {
        self.0.get(reason).copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// `corrupt_image=2, empty_caption=1`, or `none`.
    pub fn summary(&self) -> String {
        if self.is_empty() {
            return "none".into();
        }
        self.0.iter().filter(|(_, &v)| v > 0).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
    }
}
