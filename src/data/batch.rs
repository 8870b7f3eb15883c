//! Batches in host memory, laid out for zero-copy tensors, and the builder that writes samples
//! straight into them: no per-sample tensors, no extra copies, and a sample that fails half-way
//! leaves no partial row.

use candle_core::{Device, Tensor};

use super::sample::Rejected;
use super::tokenizer::TextTokenizer;
use super::transform::ImageConfig;

/// How one image lies in a batch buffer: `[3, image_size, image_size]` pixels, or a row of
/// `numel` numbers (a NaFlex tower's patches and grid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLayout {
    pub image_size: usize,
    pub numel: usize,
}

impl ImageLayout {
    pub fn of(cfg: &ImageConfig) -> Self {
        ImageLayout { image_size: cfg.image_size, numel: cfg.numel() }
    }

    pub fn square(image_size: usize) -> Self {
        ImageLayout { image_size, numel: 3 * image_size * image_size }
    }

    /// `n` images of a buffer as the image tower's input, without a copy.
    pub fn tensor(&self, pixels: Vec<f32>, n: usize, device: &Device) -> candle_core::Result<Tensor> {
        let s = self.image_size;
        if self.numel == 3 * s * s {
            Tensor::from_vec(pixels, (n, 3, s, s), device)
        } else {
            Tensor::from_vec(pixels, (n, self.numel), device)
        }
    }
}

/// A batch's distillation teacher rows (`data::teacher_feed`), row for row with the batch.
#[derive(Debug, Clone, PartialEq)]
pub enum TeacherRows {
    /// The teacher's inputs: images as its tower takes them, token ids and masks.
    Inputs { images: Vec<f32>, image: ImageLayout, ids: Vec<u32>, mask: Vec<u32>, max_len: usize },
    /// The teacher's L2-normalised embeddings, `dim` numbers a row.
    Embeddings { image: Vec<f32>, text: Vec<f32>, dim: usize },
}

/// One training batch in host memory.
#[derive(Debug, Clone)]
pub struct Batch {
    pub size: usize,
    /// `size` images of `image.numel` numbers each, normalised.
    pub images: Vec<f32>,
    pub image: ImageLayout,
    /// `size × max_len` token ids and attention mask.
    pub ids: Vec<u32>,
    pub mask: Vec<u32>,
    pub max_len: usize,
    pub keys: Vec<String>,
    pub captions: Vec<String>,
    pub labels: Vec<Option<i64>>,
    /// A distillation teacher's rows (`data::teacher_feed`), row for row.
    pub teacher: Option<TeacherRows>,
}

impl Batch {
    fn with_capacity(n: usize, image: ImageLayout, max_len: usize) -> Self {
        Batch {
            size: 0,
            images: Vec::with_capacity(n * image.numel),
            image,
            ids: Vec::with_capacity(n * max_len),
            mask: Vec::with_capacity(n * max_len),
            max_len,
            keys: Vec::with_capacity(n),
            captions: Vec::with_capacity(n),
            labels: Vec::with_capacity(n),
            teacher: None,
        }
    }

    /// Drops rows from `size` on (a row written half-way).
    fn truncate_rows(&mut self) {
        let numel = self.image.numel;
        self.images.truncate(self.size * numel);
        self.ids.truncate(self.size * self.max_len);
        self.mask.truncate(self.size * self.max_len);
    }
}

pub struct BatchBuilder {
    batch: Batch,
    batch_size: usize,
}

impl BatchBuilder {
    pub fn new(batch_size: usize, image: ImageLayout, max_len: usize) -> Self {
        BatchBuilder { batch: Batch::with_capacity(batch_size, image, max_len), batch_size }
    }

    /// Writes a sample into the next row: `write_image` fills the row's pixels, the caption is
    /// tokenised into its ids and mask. A caption the tokenizer rejects leaves the batch as it
    /// was.
    pub fn add(
        &mut self,
        key: &str,
        caption: String,
        label: Option<i64>,
        tokenizer: &TextTokenizer,
        write_image: impl FnOnce(&mut [f32]),
    ) -> Result<(), Rejected> {
        let b = &mut self.batch;
        let numel = b.image.numel;
        let start = b.images.len();
        b.images.resize(start + numel, 0.0);
        write_image(&mut b.images[start..]);
        if let Err(e) = tokenizer.encode_into(&caption, &mut b.ids, &mut b.mask) {
            b.truncate_rows();
            return Err(Rejected { reason: super::skips::reason::CAPTION_NOT_UTF8, detail: e.to_string() });
        }
        b.keys.push(key.to_string());
        b.captions.push(caption);
        b.labels.push(label);
        b.size += 1;
        Ok(())
    }

    pub fn is_full(&self) -> bool {
        self.batch.size == self.batch_size
    }

    pub fn is_empty(&self) -> bool {
        self.batch.size == 0
    }

    /// The next batch's size and image layout (a token-budget batch's); only between batches.
    pub fn reshape(&mut self, batch_size: usize, image: ImageLayout) {
        debug_assert!(self.is_empty(), "a batch is reshaped only before its first row");
        if (batch_size, image) != (self.batch_size, self.batch.image) {
            self.batch_size = batch_size;
            self.batch = Batch::with_capacity(batch_size, image, self.batch.max_len);
        }
    }

    /// The batch so far, and an empty one in its place.
    pub fn take(&mut self) -> Batch {
        let fresh = Batch::with_capacity(self.batch_size, self.batch.image, self.batch.max_len);
        std::mem::replace(&mut self.batch, fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::train_wordpiece;

    fn tokenizer(max_len: usize) -> TextTokenizer {
        let caps: Vec<String> = (0..5).map(|i| format!("a photo of thing {i}")).collect();
        TextTokenizer::new(train_wordpiece(caps.iter(), 100, true, 1).unwrap(), max_len).unwrap()
    }

    #[test]
    fn rows_land_in_place_and_a_full_batch_is_taken_whole() {
        let tok = tokenizer(6);
        let mut b = BatchBuilder::new(2, ImageLayout::square(2), 6);
        b.add("k0", "a photo of thing 0".into(), Some(3), &tok, |px| px.fill(1.0)).unwrap();
        assert!(!b.is_full());
        b.add("k1", "thing 1".into(), None, &tok, |px| px.fill(2.0)).unwrap();
        assert!(b.is_full());
        let batch = b.take();
        assert_eq!((batch.size, batch.images.len(), batch.ids.len(), batch.mask.len()), (2, 24, 12, 12));
        assert!(batch.images[..12].iter().all(|&v| v == 1.0) && batch.images[12..].iter().all(|&v| v == 2.0));
        assert_eq!(batch.keys, vec!["k0", "k1"]);
        assert_eq!(batch.labels, vec![Some(3), None]);
        // Row 1's mask covers its tokens ([CLS] thing 1 [SEP]) and no padding.
        assert_eq!(&batch.mask[6..], &[1, 1, 1, 1, 0, 0]);
        assert!(!b.is_full());
        assert_eq!(b.take().size, 0);
    }
}
