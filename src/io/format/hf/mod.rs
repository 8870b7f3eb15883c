//! Hugging Face layouts: configurations and parameter names (`layout`), `hf:` hub locations
//! (`hub`), the files of a model directory (`files`), image processors' settings (`preprocess`),
//! and, through `model_dir`'s one format for them all, one layout each for `AlignModel` (`align`), `CLIPModel` (`clip`), `SiglipModel`
//! (`siglip`), `Siglip2Model` (`siglip2`) and `VisionTextDualEncoderModel` (`vtde`) directories; `towers` holds what CLIP's
//! and SigLIP's configs and tokenizers share.

pub mod align;
pub mod clip;
pub mod files;
pub mod hub;
pub mod layout;
pub mod model_dir;
pub mod preprocess;
pub mod siglip;
pub mod siglip2;
pub mod tower_config;
pub mod towers;
pub mod vtde;
