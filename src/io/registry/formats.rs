//! The list of formats.

use crate::io::format::align_run::AlignRun;
use crate::io::format::hf::model_dir::Hf;
use crate::io::format::hf::{align::HfAlign, clip::HfClip, siglip::HfSiglip, siglip2::HfSiglip2, vtde::HfVtde};
use crate::io::format::open_clip::OpenClip;
use crate::io::format::Format;

/// Every format, in the order [`super::locate`] tries them: a directory that satisfies several (a hub
/// repository with both a `CLIPModel` and an open_clip copy) is read as the first. Among the
/// Hugging Face classes, the order is also the preference of `export --format hf`.
pub static FORMATS: [&dyn Format; 7] = [&AlignRun, &Hf(HfAlign), &Hf(HfClip), &Hf(HfSiglip), &Hf(HfSiglip2), &Hf(HfVtde), &OpenClip];

/// The format called `name` (case-insensitive).
pub fn named(name: &str) -> Option<&'static dyn Format> {
    FORMATS.iter().copied().find(|f| f.name().eq_ignore_ascii_case(name))
}

/// The formats align reads, for error messages.
pub fn read_list() -> String {
    FORMATS.iter().map(|f| format!("{} ({})", f.name(), f.describe())).collect::<Vec<_>>().join(", ")
}
