//! Model-based curation end to end: a model trained briefly on clean pairs scores a corpus where
//! 30% of the captions were moved to other images; keeping the top 70% by score removes mostly
//! the moved ones. Scoring resumes (finished shards are kept, the files are the same), the build
//! reports the score distributions and each filter's removals, MetaCLIP balancing thins a head
//! concept, and a filter that needs scores refuses an input it has none for.

mod common;

use std::collections::HashSet;
use std::path::Path;

use align::data::build::{self, filters::Filters, BuildOptions};
use align::data::curate::scores;
use align::data::shard_writer::ShardWriter;
use align::data::spec::ShardSource;
use align::data::tar_read::{read_shard_events, ShardEvent};
use align::eval::score::{score_shards, ScoreOptions};
use candle_core::Device;

/// The tiny training shards rewritten with every sample whose index is 0, 1 or 2 mod 10 given
/// another sample's caption; returns the shards and the keys of the moved pairs.
fn shuffled_corpus(train: &str, out: &Path) -> (Vec<ShardSource>, HashSet<String>) {
    let mut samples = Vec::new();
    for src in align::data::spec::expand(train).unwrap() {
        for ev in read_shard_events(&src) {
            if let ShardEvent::Sample(s) = ev {
                samples.push(s);
            }
        }
    }
    let n = samples.len();
    let captions: Vec<Vec<u8>> = samples.iter().map(|s| s.fields["txt"].clone()).collect();
    let mut moved = HashSet::new();
    let mut shards = Vec::new();
    for (part, chunk) in samples.chunks(n.div_ceil(2)).enumerate() {
        let path = out.join(format!("raw-{part:05}.tar"));
        let mut w = ShardWriter::create(&path).unwrap();
        for s in chunk {
            let i = s.key.clone();
            let index = samples.iter().position(|x| x.key == i).unwrap();
            let caption = if index % 10 < 3 {
                moved.insert(s.key.clone());
                captions[(index + n / 2 + 7) % n].clone()
            } else {
                captions[index].clone()
            };
            w.write_sample(&s.key, &[("jpg", s.fields["jpg"].clone()), ("txt", caption)]).unwrap();
        }
        w.finish().unwrap();
        shards.push(ShardSource::File(path));
    }
    (shards, moved)
}

#[test]
fn clip_scores_find_moved_captions_and_the_build_filters_on_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("run"), &["train.steps=200", "train.checkpoint_every=0"]);
    let s = align::train::trainer::train(&cfg, &common::cpu_options()).unwrap();
    let (shards, moved) = shuffled_corpus(&data.train, dir.path());

    let m = align::io::load::load_model(&s.checkpoint, &Device::Cpu).unwrap();
    let out = dir.path().join("scores");
    let o = ScoreOptions { out: out.clone(), embeddings: true, batch: 16, quiet: true, checkpoint: "tiny".into() };
    let r = score_shards(&m, &shards, &o, &Device::Cpu).unwrap();
    assert_eq!((r.shards, r.already_scored, r.samples), (2, 0, 120));

    // Scored as the model scores a pair: the cosine of its embeddings.
    let first = scores::read(&out.join("raw-00000.parquet"), true).unwrap();
    let (img, txt) = (first.image_embeddings.as_ref().unwrap(), first.text_embeddings.as_ref().unwrap());
    let d = first.dim;
    let cos: f32 = img[..d].iter().zip(&txt[..d]).map(|(a, b)| a * b).sum();
    assert!((cos - first.scores[0]).abs() < 1e-5);
    assert_eq!(first.meta("shard"), Some(shards[0].to_string().as_str()));

    // The top 70% by score: the 30% removed are mostly the moved captions.
    let table = scores::ScoreTable::load(&out, false).unwrap();
    let cut = table.quantile_threshold(0.7);
    let removed: HashSet<String> = table.by_key.iter().filter(|(_, &i)| table.scores[i] < cut).map(|(k, _)| k.clone()).collect();
    let hits = removed.intersection(&moved).count() as f64;
    let (precision, recall) = (hits / removed.len() as f64, hits / moved.len() as f64);
    assert!(precision >= 0.6 && recall >= 0.6, "precision {precision:.2}, recall {recall:.2} (chance: 0.30)");

    // A re-run keeps the finished files as they are.
    let before = std::fs::read(out.join("raw-00001.parquet")).unwrap();
    let again = score_shards(&m, &shards, &o, &Device::Cpu).unwrap();
    assert_eq!(again.already_scored, 2);
    assert_eq!(std::fs::read(out.join("raw-00001.parquet")).unwrap(), before);

    // The build: top 70% by score, then MetaCLIP over colour words with a cap of 10.
    let entries = dir.path().join("entries.txt");
    std::fs::write(&entries, "red\ngreen\nblue\nyellow\nwhite\nblack\n").unwrap();
    let filters = format!(
        "[curate]\nscores = {:?}\ntop_fraction = 0.7\n[curate.metaclip]\nentries = {:?}\nt = 10\nseed = 1\n[output]\nsamples_per_shard = 1000\n",
        out.display().to_string(),
        entries.display().to_string()
    );
    let f: Filters = toml::from_str(&filters).unwrap();
    let spec = format!("{}/raw-{{00000..00001}}.tar", dir.path().display());
    let report = build::build(&BuildOptions {
        input: spec.clone(),
        image_root: None,
        out: dir.path().join("clean"),
        filters: f,
        exclude_near: vec![],
        quiet: true,
    })
    .unwrap();
    let removed_by = |name: &str| report.removed.iter().find(|r| r.filter == name).unwrap().samples;
    assert_eq!(removed_by("clip_score"), 36, "{:?}", report.removed);
    let sr = report.clip_score.as_ref().unwrap();
    assert!(sr.after.min >= sr.threshold as f64 - 1e-6 && sr.before.min < sr.after.min, "{sr:?}");
    let mc = report.metaclip.as_ref().unwrap();
    assert!(removed_by("metaclip_balance") > 0 && mc.head_share_after < mc.head_share_before, "{mc:?}");
    assert!(std::fs::read_to_string(&mc.counts_file).unwrap().starts_with("entry\tbefore\tafter\nred\t"));
    assert_eq!(report.kept + removed_by("clip_score") + removed_by("metaclip_balance"), 120);

    // Scores for another input: the build names what is missing.
    let jpg = read_shard_events(&shards[0])
        .into_iter()
        .find_map(|e| if let ShardEvent::Sample(s) = e { Some(s.fields["jpg"].clone()) } else { None })
        .unwrap();
    let other = dir.path().join("other-00000.tar");
    let mut w = ShardWriter::create(&other).unwrap();
    w.write_sample("unscored", &[("jpg", jpg), ("txt", b"a red shape on a black background".to_vec())]).unwrap();
    w.finish().unwrap();
    let f: Filters = toml::from_str(&format!("[curate]\nscores = {:?}\nmin_score = 0.1\n", out.display().to_string())).unwrap();
    let err = build::build(&BuildOptions {
        input: other.display().to_string(),
        image_root: None,
        out: dir.path().join("clean2"),
        filters: f,
        exclude_near: vec![],
        quiet: true,
    })
    .expect_err("an unscored input must not build");
    let err = format!("{err:#}");
    assert!(err.contains("no score") && err.contains("unscored") && err.contains("align data score"), "{err}");
}

#[test]
fn filters_that_need_what_is_not_there_say_so() {
    let e = format!("{:#}", toml::from_str::<Filters>("[curate]\ntop_fraction = 0.3\n").unwrap().validate().unwrap_err());
    assert!(e.contains("curate.scores"), "{e}");
    let e = format!("{:#}", toml::from_str::<Filters>("[curate.metaclip]\nt = 100\n").unwrap().validate().unwrap_err());
    assert!(e.contains("curate.metaclip.entries"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let latin1 = dir.path().join("entries.txt");
    std::fs::write(&latin1, b"caf\xe9\n").unwrap();
    let e = format!("{:#}", align::data::curate::metaclip::Matcher::from_file(&latin1).err().unwrap());
    assert!(e.contains("not UTF-8") && e.contains("entries.txt"), "{e}");
    let e = format!("{:#}", scores::ScoreTable::load(dir.path(), false).err().unwrap());
    assert!(e.contains("no score files"), "{e}");
}
