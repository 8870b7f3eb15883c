//! Hugging Face layouts: configurations and parameter names (`layout`), `hf:` hub locations
//! (`hub`), the files of a model directory (`files`), image processors' settings (`preprocess`), and
//! `AlignModel` directories in and out (`align`).

pub mod align;
pub mod files;
pub mod hub;
pub mod layout;
pub mod preprocess;
