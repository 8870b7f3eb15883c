//! Hugging Face layouts: configurations and parameter names (`layout`), `hf:` hub locations
//! (`hub`), the files of a model directory (`files`), image processors' settings (`preprocess`),
//! `AlignModel` directories in and out (`align`), `CLIPModel` / `SiglipModel` ones (`clip`), and `VisionTextDualEncoderModel` ones (`vtde`).

pub mod align;
pub mod clip;
pub mod files;
pub mod hub;
pub mod layout;
pub mod preprocess;
pub mod vtde;
