//! align's own checkpoints (`RUN/step-N/`, see `io::run_dir`): the sizes in `align.json`, the
//! weights and their moving average in safetensors files under align's names, the run's
//! `tokenizer.json`, and the preprocessing and text length of its `config.toml`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

use super::{Format, HubFetch, Usage};
use crate::config::Config;
use crate::data::tokenizer::TextTokenizer;
use crate::io::run_dir::{read_state, CONFIG_FILE, EMA_FILE, MODEL_FILE, SPEC_FILE, TOKENIZER_FILE};
use crate::io::tensors::read_tensors;
use crate::model::dual_encoder::ModelSpec;

pub struct AlignRun;

fn config(dir: &Path) -> Result<Config> {
    Config::load(&dir.join(CONFIG_FILE), &[])
}

impl Format for AlignRun {
    fn name(&self) -> &'static str {
        "align"
    }

    fn describe(&self) -> &'static str {
        "an align checkpoint, or a run directory for its latest"
    }

    fn claims(&self, dir: &Path) -> bool {
        dir.join(SPEC_FILE).is_file()
    }

    fn config_file(&self) -> &'static str {
        SPEC_FILE
    }

    fn has_weights(&self, dir: &Path) -> bool {
        dir.join(MODEL_FILE).is_file()
    }

    fn fetch_from_hub(&self, fetch: &mut HubFetch) -> Result<()> {
        for file in [SPEC_FILE, MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE] {
            fetch(file)?;
        }
        Ok(())
    }

    fn spec(&self, dir: &Path) -> Result<ModelSpec> {
        let path = dir.join(SPEC_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let spec: ModelSpec = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        crate::io::limits::check_spec(&spec).with_context(|| format!("{}", path.display()))?;
        Ok(spec)
    }

    fn weights(&self, dir: &Path, _spec: &ModelSpec, device: &Device) -> Result<HashMap<String, Tensor>> {
        read_tensors(&dir.join(MODEL_FILE), device)
    }

    fn ema_weights(&self, dir: &Path, device: &Device) -> Result<Option<HashMap<String, Tensor>>> {
        let file = dir.join(EMA_FILE);
        if !file.is_file() {
            return Ok(None);
        }
        read_tensors(&file, device).map(Some)
    }

    fn tokenizer(&self, dir: &Path, _spec: &ModelSpec, max_len: Option<usize>) -> Result<TextTokenizer> {
        let max_len = match max_len {
            Some(m) => m,
            None => config(dir)?.text.max_len,
        };
        TextTokenizer::from_file(&dir.join(TOKENIZER_FILE), max_len)
    }

    fn usage(&self, dir: &Path, _spec: &ModelSpec) -> Result<Usage> {
        let c = config(dir)?;
        Ok(Usage { image: c.data.image, text_len: c.text.max_len, loss: c.loss.kind })
    }

    fn step(&self, dir: &Path) -> Option<u64> {
        read_state(dir).ok().map(|s| s.step)
    }
}
