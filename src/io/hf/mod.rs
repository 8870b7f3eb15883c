//! Hugging Face layouts: configurations and parameter names (`layout`), `hf:` hub locations
//! (`hub`), the files of a model directory (`files`), image processors' settings (`preprocess`),
//! `AlignModel` directories in and out (`align`), and `CLIPModel` / `SiglipModel` ones in (`clip`).

pub mod align;
pub mod clip;
pub mod files;
pub mod hub;
pub mod layout;
pub mod preprocess;
