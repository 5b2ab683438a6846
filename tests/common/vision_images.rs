//! The test images of tests/vision/images (scripts/make_test_images.py), each with a libmtmd golden
//! per family in tests/golden/vision: odd sizes and aspects, every PNG colour type, both JPEG kinds.

pub const IMAGES: [&str; 7] = [
    "rgb_1x1.png",
    "rgb_3000x200.png",
    "gray_37x53.png",
    "rgba_41x29.png",
    "palette_33x47.png",
    "progressive_64x48.jpg",
    "baseline_200x120.jpg",
];
