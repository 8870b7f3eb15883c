//! A plotters drawing backend over an in-memory RGB image, with text from the fixed-width
//! bitmap fonts of `embedded-graphics`: plots render the same everywhere, with no system font
//! library or font file to find.

use std::convert::Infallible;

use embedded_graphics::mono_font::ascii::{FONT_10X20, FONT_6X10, FONT_7X13, FONT_9X15};
use embedded_graphics::mono_font::{MonoFont, MonoTextStyle};
use embedded_graphics::pixelcolor::BinaryColor;
use embedded_graphics::prelude::{DrawTarget, OriginDimensions, Pixel, Point, Size};
use embedded_graphics::text::{Baseline, Text};
use embedded_graphics::Drawable;
use image::RgbImage;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{BackendColor, BackendCoord, BackendTextStyle, DrawingBackend, DrawingErrorKind};

pub struct Canvas<'a> {
    img: &'a mut RgbImage,
}

impl<'a> Canvas<'a> {
    pub fn new(img: &'a mut RgbImage) -> Self {
        Canvas { img }
    }
}

/// The largest font no taller than the requested size (the smallest one below that).
fn font_for(size: f64) -> &'static MonoFont<'static> {
    [&FONT_10X20, &FONT_9X15, &FONT_7X13, &FONT_6X10]
        .into_iter()
        .find(|f| f.character_size.height as f64 <= size.max(10.0))
        .unwrap_or(&FONT_6X10)
}

fn text_size(font: &MonoFont, text: &str) -> (u32, u32) {
    let n = text.chars().count() as u32;
    let w = font.character_size.width + font.character_spacing;
    ((n * w).saturating_sub(font.character_spacing), font.character_size.height)
}

/// Collects the lit pixels of rendered text.
struct Glyphs(Vec<Point>);

impl OriginDimensions for Glyphs {
    fn size(&self) -> Size {
        Size::new(u32::MAX / 2, u32::MAX / 2)
    }
}

impl DrawTarget for Glyphs {
    type Color = BinaryColor;
    type Error = Infallible;

    fn draw_iter<I: IntoIterator<Item = Pixel<BinaryColor>>>(&mut self, pixels: I) -> Result<(), Infallible> {
        self.0.extend(pixels.into_iter().filter(|Pixel(_, c)| c.is_on()).map(|Pixel(p, _)| p));
        Ok(())
    }
}

impl DrawingBackend for Canvas<'_> {
    type ErrorType = Infallible;

    fn get_size(&self) -> (u32, u32) {
        self.img.dimensions()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Infallible>> {
        Ok(())
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Infallible>> {
        Ok(())
    }

    fn draw_pixel(&mut self, (x, y): BackendCoord, color: BackendColor) -> Result<(), DrawingErrorKind<Infallible>> {
        let (w, h) = self.img.dimensions();
        if x < 0 || y < 0 || x as u32 >= w || y as u32 >= h || color.alpha <= 0.0 {
            return Ok(());
        }
        let a = color.alpha.min(1.0);
        let px = self.img.get_pixel_mut(x as u32, y as u32);
        let new = [color.rgb.0, color.rgb.1, color.rgb.2];
        for (old, new) in px.0.iter_mut().zip(new) {
            *old = (*old as f64 * (1.0 - a) + new as f64 * a).round() as u8;
        }
        Ok(())
    }

    fn draw_text<S: BackendTextStyle>(&mut self, text: &str, style: &S, pos: BackendCoord) -> Result<(), DrawingErrorKind<Infallible>> {
        let font = font_for(style.size());
        let (w, h) = text_size(font, text);
        let (w, h) = (w as i32, h as i32);
        let dx = match style.anchor().h_pos {
            HPos::Left => 0,
            HPos::Center => -w / 2,
            HPos::Right => -w,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0,
            VPos::Center => -h / 2,
            VPos::Bottom => -h,
        };
        let mut glyphs = Glyphs(Vec::new());
        let _ = Text::with_baseline(text, Point::zero(), MonoTextStyle::new(font, BinaryColor::On), Baseline::Top).draw(&mut glyphs);
        let transform = style.transform();
        let color = style.color();
        for p in glyphs.0 {
            let (x, y) = transform.transform(p.x + dx, p.y + dy);
            self.draw_pixel((pos.0 + x, pos.1 + y), color)?;
        }
        Ok(())
    }

    fn estimate_text_size<S: BackendTextStyle>(&self, text: &str, style: &S) -> Result<(u32, u32), DrawingErrorKind<Infallible>> {
        Ok(text_size(font_for(style.size()), text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::prelude::{IntoDrawingArea, IntoFont, PathElement, BLACK, RED};

    #[test]
    fn text_lands_inside_its_anchor_box_and_lines_are_drawn() {
        let mut img = RgbImage::from_pixel(200, 100, image::Rgb([255, 255, 255]));
        {
            let root = Canvas::new(&mut img).into_drawing_area();
            root.draw(&plotters::element::Text::new("Hi", (50, 20), ("sans-serif", 20).into_font().color(&BLACK))).unwrap();
            root.draw(&PathElement::new(vec![(0, 90), (199, 90)], RED)).unwrap();
            root.present().unwrap();
        }
        let dark: Vec<(u32, u32)> = img.enumerate_pixels().filter(|(_, _, p)| p.0 == [0, 0, 0]).map(|(x, y, _)| (x, y)).collect();
        assert!(dark.len() > 20, "text drew {} pixels", dark.len());
        // FONT_10X20: two 10-pixel cells from the anchor at the top-left.
        assert!(dark.iter().all(|&(x, y)| (50..70).contains(&x) && (20..40).contains(&y)), "{dark:?}");
        assert!((0..200).all(|x| img.get_pixel(x, 90).0 == [255, 0, 0]));
    }
}
