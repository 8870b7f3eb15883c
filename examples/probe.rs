use std::sync::Arc;
use align::config::Config;
use align::data::distribute::{Placement, ShardPlan};
use align::data::loader::{LoaderSettings, TrainLoader};
use align::data::tokenizer::TextTokenizer;
use align::model::dual_encoder::{DualEncoder};
use align::model::init::SeededVars;
use align::train::optim::Optimizer;
use candle_core::{Device, Tensor, D};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = "/tmp/exp-e5/data";
    let tok = Arc::new(TextTokenizer::from_file(std::path::Path::new(&format!("{dir}/tokenizer.json")), 20)?);
    let mut o = vec!["model.image_tower=\"vit\"".to_string(), "model.text_tower=\"bert\"".into(), "model.embed_dim=36".into(),
        "model.vit={patch_size = 8, width = 128, depth = 3, heads = 4}".into(), "model.bert={hidden = 32, layers = 1, heads = 2, intermediate = 64, max_position = 32}".into(),
        "data.image.image_size=32".into(), "data.image.resize=36".into(), "text.max_len=20".into()];
    o.extend(args);
    let cfg = Config::from_str_with_overrides("", "probe", &o)?;
    let spec = cfg.model_spec(tok.vocab_size())?;
    let vm = candle_nn::VarMap::new();
    let dev = Device::Cpu;
    let model = DualEncoder::new(&spec, SeededVars::builder(&vm, 0, &dev))?;
    let vars: Vec<_> = vm.data().lock().unwrap().iter().filter(|(k, _)| k.starts_with("vision") || k.starts_with("visual")).map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut ocfg = cfg.optimizer.clone();
    ocfg.kind = align::train::optim::OptimizerKind::Adamw;
    let mlp = std::env::var("MLP").is_ok();
    let w1 = candle_core::Var::from_tensor(&(Tensor::randn(0f32, 1.0, (256, 3 * 32 * 32), &dev)? * 0.018)?)?;
    let w2 = candle_core::Var::from_tensor(&(Tensor::randn(0f32, 1.0, (36, 256), &dev)? * 0.06)?)?;
    let vars = if mlp { vec![("w1".to_string(), w1.clone()), ("w2".to_string(), w2.clone())] } else { vars };
    let mut opt = Optimizer::new(vars, ocfg)?;
    let shards = align::data::spec::expand(&format!("{dir}/train-{{00000..00007}}.tar"))?;
    let plan = ShardPlan { shards, seed: 0, shuffle: true, resampled: false };
    let mut loader = TrainLoader::start(plan, Placement::single(2), LoaderSettings { image: cfg.data.image.clone(), batch_size: 128, shuffle_buffer: 1000, seed: 0, prefetch: 2 }, tok.clone(), None)?;
    for step in 0..300 {
        let b = loader.next_batch()?;
        let s = b.image_size;
        let n = b.size;
        let labels: Vec<u32> = b.labels.iter().map(|l| l.unwrap() as u32).collect();
        let images = Tensor::from_vec(b.images, (n, 3, s, s), &dev)?;
        let logits = if mlp { let x = images.flatten_from(1)?; let h = x.matmul(&w1.as_tensor().t()?)?.relu()?; h.matmul(&w2.as_tensor().t()?)? } else { (model.image_embeddings(&images)? * 10.0)? };
        let lab = Tensor::new(labels.clone(), &dev)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &lab)?;
        let g = opt.gather(&loss.backward()?);
        opt.step(&g, 1e-3)?;
        if step % 25 == 0 {
            let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            let (mut c, mut sh) = (0, 0);
            for (p, l) in pred.iter().zip(&labels) { c += (p / 6 == l / 6) as usize; sh += (p % 6 == l % 6) as usize; }
            println!("step {step} loss {:.3} colour acc {:.2} shape acc {:.2}", loss.to_scalar::<f32>()?, c as f64 / n as f64, sh as f64 / n as f64);
        }
    }
    Ok(())
}
