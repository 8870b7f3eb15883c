//! Ranking metrics on embedding matrices, computed block by block so that MSCOCO's 5k images ×
//! 25k captions never needs the full similarity matrix at once.
//!
//! Ties: a candidate ranks as in a stable sort by descending score, i.e. its rank is the number
//! of candidates scoring strictly higher plus the tied ones with a smaller index. This is what
//! `argsort` with a stable sort gives in the usual Python evaluation code.

use candle_core::{Device, Result, Tensor};
use serde::ser::{Serialize, SerializeMap, Serializer};

/// Row-major `rows × dim` matrix of L2-normalised embeddings.
#[derive(Debug, Clone)]
pub struct Embeddings {
    pub data: Vec<f32>,
    pub dim: usize,
}

impl Embeddings {
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.dim).unwrap_or(0)
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }

    pub fn from_tensor(t: &Tensor) -> Result<Self> {
        let (_, dim) = t.dims2()?;
        Ok(Embeddings { data: t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?, dim })
    }

    fn block_tensor(&self, start: usize, len: usize) -> Result<Tensor> {
        Tensor::from_slice(&self.data[start * self.dim..(start + len) * self.dim], (len, self.dim), &Device::Cpu)
    }
}

/// Calls `f(first_query_row, block)` with `block` the `len × candidates` similarity rows.
pub fn for_each_similarity_block(
    queries: &Embeddings,
    candidates: &Embeddings,
    block: usize,
    mut f: impl FnMut(usize, &[f32]),
) -> Result<()> {
    if queries.dim != candidates.dim {
        candle_core::bail!("embedding sizes differ: {} vs {}", queries.dim, candidates.dim);
    }
    let cand = candidates.block_tensor(0, candidates.rows())?.t()?.contiguous()?;
    let mut start = 0;
    while start < queries.rows() {
        let len = block.min(queries.rows() - start);
        let sims = queries.block_tensor(start, len)?.matmul(&cand)?.flatten_all()?.to_vec1::<f32>()?;
        f(start, &sims);
        start += len;
    }
    Ok(())
}

/// Rank (0 = best) of candidate `target` within one row of scores.
pub fn rank_of(scores: &[f32], target: usize) -> usize {
    let s = scores[target];
    scores.iter().enumerate().filter(|&(j, &v)| v > s || (v == s && j < target)).count()
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Recall {
    pub r1: f64,
    pub r5: f64,
    pub r10: f64,
}

impl Recall {
    fn from_ranks(ranks: &[usize]) -> Self {
        Recall { r1: recall_at(ranks, 1), r5: recall_at(ranks, 5), r10: recall_at(ranks, 10) }
    }

    pub fn mean(&self) -> f64 {
        (self.r1 + self.r5 + self.r10) / 3.0
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RetrievalReport {
    pub i2t: Recall,
    pub t2i: Recall,
    /// Sum of the six recalls in percent, the usual single retrieval number in tables; machines
    /// get it as `mean_recall`, a fraction like every other metric (rsum = 600 × mean_recall).
    pub rsum: f64,
    pub images: usize,
    pub texts: usize,
}

/// Written in CLIP_benchmark's vocabulary, as fractions, so a training log, a run summary and
/// `align eval retrieval --json` name the same number alike: `text_retrieval_recall@K` is
/// image→text (an image finding its captions), `image_retrieval_recall@K` text→image.
impl Serialize for RetrievalReport {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(9))?;
        for (k, i2t, t2i) in [(1, self.i2t.r1, self.t2i.r1), (5, self.i2t.r5, self.t2i.r5), (10, self.i2t.r10, self.t2i.r10)] {
            m.serialize_entry(&format!("image_retrieval_recall@{k}"), &t2i)?;
            m.serialize_entry(&format!("text_retrieval_recall@{k}"), &i2t)?;
        }
        m.serialize_entry("mean_recall", &self.mean_recall())?;
        m.serialize_entry("images", &self.images)?;
        m.serialize_entry("texts", &self.texts)?;
        m.end()
    }
}

/// Each query's rank (0 = best) of its nearest correct candidate: per image, its best-ranked
/// caption among all captions (image→text, CLIP_benchmark's "text retrieval"); per caption, its
/// image among all images (text→image, "image retrieval").
#[derive(Debug, Clone, PartialEq)]
pub struct Ranks {
    pub i2t: Vec<usize>,
    pub t2i: Vec<usize>,
}

/// The fraction of queries whose rank is below `k`: recall@k.
pub fn recall_at(ranks: &[usize], k: usize) -> f64 {
    ranks.iter().filter(|&&r| r < k).count() as f64 / ranks.len().max(1) as f64
}

/// Image→text and text→image recall. `text_image[t]` is the image caption `t` belongs to. An
/// image→text query hits at K when any of its captions ranks in the top K.
pub fn retrieval(images: &Embeddings, texts: &Embeddings, text_image: &[usize], block: usize) -> Result<RetrievalReport> {
    Ok(RetrievalReport::from_ranks(&retrieval_ranks(images, texts, text_image, block)?))
}

impl RetrievalReport {
    /// The mean of the six recalls, a fraction: rsum / 600.
    pub fn mean_recall(&self) -> f64 {
        self.rsum / 600.0
    }

    pub fn from_ranks(ranks: &Ranks) -> Self {
        let (i2t, t2i) = (Recall::from_ranks(&ranks.i2t), Recall::from_ranks(&ranks.t2i));
        RetrievalReport {
            i2t,
            t2i,
            rsum: 100.0 * (i2t.r1 + i2t.r5 + i2t.r10 + t2i.r1 + t2i.r5 + t2i.r10),
            images: ranks.i2t.len(),
            texts: ranks.t2i.len(),
        }
    }
}

/// The [`Ranks`] of every image and caption query.
pub fn retrieval_ranks(images: &Embeddings, texts: &Embeddings, text_image: &[usize], block: usize) -> Result<Ranks> {
    if text_image.len() != texts.rows() {
        candle_core::bail!("{} captions but {} caption→image links", texts.rows(), text_image.len());
    }
    let mut captions_of: Vec<Vec<usize>> = vec![Vec::new(); images.rows()];
    for (t, &i) in text_image.iter().enumerate() {
        if i >= images.rows() {
            candle_core::bail!("caption {t} points at image {i} of {}", images.rows());
        }
        captions_of[i].push(t);
    }
    let mut i2t = Vec::with_capacity(images.rows());
    for_each_similarity_block(images, texts, block, |start, sims| {
        let n = texts.rows();
        for (r, row) in sims.chunks(n).enumerate() {
            let best = captions_of[start + r].iter().map(|&t| rank_of(row, t)).min().unwrap_or(usize::MAX);
            i2t.push(best);
        }
    })?;
    let mut t2i = Vec::with_capacity(texts.rows());
    for_each_similarity_block(texts, images, block, |start, sims| {
        let n = images.rows();
        for (r, row) in sims.chunks(n).enumerate() {
            t2i.push(rank_of(row, text_image[start + r]));
        }
    })?;
    Ok(Ranks { i2t, t2i })
}

/// Written in CLIP_benchmark's vocabulary (`acc1`, `acc5`, `mean_per_class_recall`), as fractions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClassificationReport {
    #[serde(rename = "acc1")]
    pub top1: f64,
    #[serde(rename = "acc5")]
    pub top5: f64,
    /// Top-1 recall of each class that has images, averaged over those classes (CLIP_benchmark's
    /// `mean_per_class_recall`, scikit-learn's balanced accuracy).
    pub mean_per_class_recall: f64,
    pub images: usize,
    pub classes: usize,
}

/// Top-1 / top-5 accuracy of images against class embeddings.
pub fn classify(images: &Embeddings, labels: &[usize], classes: &Embeddings, block: usize) -> Result<ClassificationReport> {
    let (mut top1, mut top5) = (0usize, 0usize);
    // Per class: images, and images ranked first.
    let mut per_class = vec![(0usize, 0usize); classes.rows()];
    for_each_similarity_block(images, classes, block, |start, sims| {
        for (r, row) in sims.chunks(classes.rows()).enumerate() {
            let label = labels[start + r];
            let rank = rank_of(row, label);
            top1 += (rank < 1) as usize;
            top5 += (rank < 5) as usize;
            per_class[label].0 += 1;
            per_class[label].1 += (rank < 1) as usize;
        }
    })?;
    let n = images.rows().max(1) as f64;
    let present: Vec<f64> = per_class.iter().filter(|(n, _)| *n > 0).map(|&(n, hits)| hits as f64 / n as f64).collect();
    let mean_per_class_recall = present.iter().sum::<f64>() / present.len().max(1) as f64;
    Ok(ClassificationReport {
        top1: top1 as f64 / n,
        top5: top5 as f64 / n,
        mean_per_class_recall,
        images: images.rows(),
        classes: classes.rows(),
    })
}

/// CLIP's prompt ensemble: per class, the mean of the L2-normalised embeddings of every template,
/// renormalised. `per_template` holds `classes × templates` rows, class-major.
pub fn ensemble(per_template: &Embeddings, templates: usize) -> Embeddings {
    let dim = per_template.dim;
    let classes = per_template.rows() / templates;
    let mut data = vec![0.0f32; classes * dim];
    for c in 0..classes {
        let out = &mut data[c * dim..(c + 1) * dim];
        for t in 0..templates {
            for (o, v) in out.iter_mut().zip(per_template.row(c * templates + t)) {
                *o += v / templates as f32;
            }
        }
        let norm = out.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        out.iter_mut().for_each(|v| *v /= norm);
    }
    Embeddings { data, dim }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emb(rows: &[&[f32]]) -> Embeddings {
        Embeddings { data: rows.iter().flat_map(|r| r.iter().copied()).collect(), dim: rows[0].len() }
    }

    #[test]
    fn ties_rank_by_index_like_a_stable_sort() {
        assert_eq!(rank_of(&[0.5, 0.9, 0.5, 0.1], 0), 1);
        assert_eq!(rank_of(&[0.5, 0.9, 0.5, 0.1], 2), 2);
        assert_eq!(rank_of(&[0.5, 0.9, 0.5, 0.1], 1), 0);
    }

    /// Brute force over the full similarity matrix, written independently of the block code.
    fn brute(images: &Embeddings, texts: &Embeddings, link: &[usize], k: usize) -> (f64, f64) {
        let sim = |i: usize, t: usize| images.row(i).iter().zip(texts.row(t)).map(|(a, b)| a * b).sum::<f32>();
        let mut i2t = 0;
        for i in 0..images.rows() {
            let mut order: Vec<usize> = (0..texts.rows()).collect();
            order.sort_by(|&a, &b| sim(i, b).partial_cmp(&sim(i, a)).unwrap());
            i2t += order[..k.min(order.len())].iter().any(|&t| link[t] == i) as usize;
        }
        let mut t2i = 0;
        for (t, &image) in link.iter().enumerate() {
            let mut order: Vec<usize> = (0..images.rows()).collect();
            order.sort_by(|&a, &b| sim(b, t).partial_cmp(&sim(a, t)).unwrap());
            t2i += order[..k.min(order.len())].contains(&image) as usize;
        }
        (i2t as f64 / images.rows() as f64, t2i as f64 / texts.rows() as f64)
    }

    #[test]
    fn recall_matches_brute_force_with_several_captions_per_image_and_any_block_size() {
        let mut rng = crate::util::rng::Rng::new(4);
        let mk = |n: usize, rng: &mut crate::util::rng::Rng| {
            let mut e = Embeddings { data: (0..n * 6).map(|_| rng.normal() as f32).collect(), dim: 6 };
            for r in 0..n {
                let row = &mut e.data[r * 6..(r + 1) * 6];
                let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                row.iter_mut().for_each(|v| *v /= norm);
            }
            e
        };
        let images = mk(23, &mut rng);
        let texts = mk(23 * 3, &mut rng);
        let link: Vec<usize> = (0..69).map(|t| t / 3).collect();
        for block in [1, 7, 100] {
            let rep = retrieval(&images, &texts, &link, block).unwrap();
            for (k, got_i2t, got_t2i) in [(1, rep.i2t.r1, rep.t2i.r1), (5, rep.i2t.r5, rep.t2i.r5), (10, rep.i2t.r10, rep.t2i.r10)] {
                let (want_i2t, want_t2i) = brute(&images, &texts, &link, k);
                assert!((got_i2t - want_i2t).abs() < 1e-12 && (got_t2i - want_t2i).abs() < 1e-12, "k={k} block={block}");
            }
        }
    }

    #[test]
    fn hand_made_retrieval_with_a_tie_and_k_beyond_the_pool() {
        let images = emb(&[&[1.0, 0.0], &[0.0, 1.0]]);
        // Caption 0 and 1 describe image 0, caption 2 image 1; caption 1 is equally close to both.
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let texts = emb(&[&[1.0, 0.0], &[s, s], &[0.0, 1.0]]);
        let rep = retrieval(&images, &texts, &[0, 0, 1], 2).unwrap();
        assert_eq!(rep.i2t.r1, 1.0);
        // Caption 1 ties between images 0 and 1: the stable order puts image 0 first, a hit.
        assert_eq!(rep.t2i.r1, 1.0);
        assert_eq!(rep.t2i.r5, 1.0);
        assert_eq!((rep.images, rep.texts), (2, 3));
        let rep = retrieval(&images, &texts, &[1, 1, 0], 2).unwrap();
        assert_eq!(rep.t2i.r1, 0.0);
        // Only two images: every caption's image is within the top 5.
        assert_eq!(rep.t2i.r5, 1.0);
    }

    #[test]
    fn ensembling_by_hand() {
        // Two templates for one class: [1,0] and [0,1] average to [0.5,0.5], renormalised.
        let per = emb(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 0.0], &[1.0, 0.0]]);
        let e = ensemble(&per, 2);
        let s = std::f32::consts::FRAC_1_SQRT_2;
        assert!((e.row(0)[0] - s).abs() < 1e-6 && (e.row(0)[1] - s).abs() < 1e-6);
        assert_eq!(e.row(1), &[1.0, 0.0]);
    }

    #[test]
    fn classification_top1_and_top5() {
        let classes = emb(&[&[1.0, 0.0], &[0.0, 1.0], &[-1.0, 0.0]]);
        let images = emb(&[&[0.9, 0.1], &[0.1, 0.9], &[0.8, 0.2]]);
        let rep = classify(&images, &[0, 1, 2], &classes, 2).unwrap();
        assert!((rep.top1 - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(rep.top5, 1.0);
        // Class 0 has two images (both right), class 1 one (wrong), class 2 none: (1 + 0) / 2,
        // where plain accuracy is 2 / 3.
        let rep = classify(&images, &[0, 2, 0], &classes, 2).unwrap();
        assert!((rep.top1 - 2.0 / 3.0).abs() < 1e-12);
        assert!((rep.mean_per_class_recall - 0.5).abs() < 1e-12, "{}", rep.mean_per_class_recall);
    }
}
