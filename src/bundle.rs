//! std layer: one-file bundles, a pinfer executable carrying its model (`pinfer bundle`).
//!
//! Layout: the executable's ELF image as built, zeros up to a multiple of [`ALIGN`], the model's
//! GGUF bytes (the file, or a repacked-weight cache of it), then a [`TRAILER_LEN`]-byte trailer
//! (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `PINFBNDL` |
//! | 8..12 | format version (1) |
//! | 12..16 | flags (bit 0: the model is a repacked-weight cache) |
//! | 16..24 | offset of the model in the file |
//! | 24..32 | length of the model |
//! | 32..40 | length of the model's GGUF header (metadata and tensor index) |
//! | 40..44 | CRC32 of that header |
//! | 44..48 | CRC32 of trailer bytes 0..44 |
//!
//! The model is mapped from the executable's own file at its offset (no copy: the same pages and
//! speed as `-m`); the tensors' alignment inside the GGUF holds in the mapping because the offset
//! is a multiple of the largest page size. Before any model byte is used the trailer, the extent
//! and the header checksum are checked; an executable with bytes after its ELF image but no valid
//! trailer is a truncated or damaged bundle, refused as such.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::string::{String, ToString};
use std::{format, vec};

/// Bundle trailer magic.
pub const MAGIC: &[u8; 8] = b"PINFBNDL";
/// Format version written and read.
pub const VERSION: u32 = 1;
/// Bytes of the trailer.
pub const TRAILER_LEN: usize = 48;
/// The model's offset is a multiple of this: 64 KiB, the largest page size of aarch64 Linux.
pub const ALIGN: u64 = 64 << 10;
/// What a damaged trailer is reported as. Also how `pinfer bundle` recognises a pinfer that reads
/// bundles: the text is among its constants (the magic, compared as one integer, may not be).
pub const DAMAGED_TRAILER: &str = "its pinfer bundle trailer is damaged (checksum mismatch)";
/// [`Trailer::flags`]: the model is a repacked-weight cache.
pub const FLAG_REPACKED: u32 = 1;

/// A bundle's trailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// [`FLAG_REPACKED`] or 0.
    pub flags: u32,
    /// Where the model starts in the file (a multiple of [`ALIGN`]).
    pub model_offset: u64,
    /// The model's bytes.
    pub model_len: u64,
    /// Bytes of the model's GGUF header (up to its tensor data).
    pub header_len: u64,
    /// CRC32 of those bytes.
    pub header_crc: u32,
}

impl Trailer {
    /// The trailer's bytes.
    pub fn encode(&self) -> [u8; TRAILER_LEN] {
        let mut t = [0u8; TRAILER_LEN];
        t[0..8].copy_from_slice(MAGIC);
        t[8..12].copy_from_slice(&VERSION.to_le_bytes());
        t[12..16].copy_from_slice(&self.flags.to_le_bytes());
        t[16..24].copy_from_slice(&self.model_offset.to_le_bytes());
        t[24..32].copy_from_slice(&self.model_len.to_le_bytes());
        t[32..40].copy_from_slice(&self.header_len.to_le_bytes());
        t[40..44].copy_from_slice(&self.header_crc.to_le_bytes());
        let crc = crc32fast::hash(&t[..44]);
        t[44..48].copy_from_slice(&crc.to_le_bytes());
        t
    }

    /// The trailer in `t` if it has the magic (`Ok(None)` without), checked against a file of
    /// `file_len` bytes.
    pub fn decode(t: &[u8; TRAILER_LEN], file_len: u64) -> Result<Option<Self>, String> {
        if &t[0..8] != MAGIC {
            return Ok(None);
        }
        let u32_at = |at: usize| u32::from_le_bytes([t[at], t[at + 1], t[at + 2], t[at + 3]]);
        let u64_at = |at: usize| u64::from_le_bytes(t[at..at + 8].try_into().unwrap_or([0; 8]));
        if crc32fast::hash(&t[..44]) != u32_at(44) {
            return Err(DAMAGED_TRAILER.into());
        }
        if u32_at(8) != VERSION {
            return Err(format!("bundle format {} (this pinfer reads {VERSION})", u32_at(8)));
        }
        let trailer = Self {
            flags: u32_at(12),
            model_offset: u64_at(16),
            model_len: u64_at(24),
            header_len: u64_at(32),
            header_crc: u32_at(40),
        };
        let end = trailer
            .model_offset
            .checked_add(trailer.model_len)
            .and_then(|e| e.checked_add(TRAILER_LEN as u64));
        if trailer.model_offset % ALIGN != 0
            || end != Some(file_len)
            || trailer.header_len > trailer.model_len
        {
            return Err("the bundled model is truncated or the bundle was altered (its extent does not match the file)"
                .into());
        }
        Ok(Some(trailer))
    }
}

/// What an executable file holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Contents {
    /// Not an ELF file (a model file, say).
    NotElf,
    /// An executable and nothing after its ELF image: no model.
    Plain,
    /// A bundle: its trailer (checked against the file's length; the header checksum is checked
    /// on the mapped bytes, [`check_header`]).
    Bundle(Trailer),
}

/// The end of the ELF image in `file` (`None` when it is no little-endian ELF64 file): the
/// furthest of the header tables, the segments' and the sections' file extents.
pub fn elf_end(file: &mut File) -> Result<Option<u64>, std::io::Error> {
    let mut ident = [0u8; 64];
    file.seek(SeekFrom::Start(0))?;
    let n = read_up_to(file, &mut ident)?;
    if n < 64 || &ident[..4] != b"\x7fELF" || ident[4] != 2 || ident[5] != 1 {
        return Ok(None);
    }
    let u16_at = |b: &[u8], at: usize| u64::from(u16::from_le_bytes([b[at], b[at + 1]]));
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
    let (phoff, shoff) = (u64_at(&ident, 0x20), u64_at(&ident, 0x28));
    let (phentsize, phnum) = (u16_at(&ident, 0x36), u16_at(&ident, 0x38));
    let (shentsize, shnum) = (u16_at(&ident, 0x3A), u16_at(&ident, 0x3C));
    let mut end = (phoff + phentsize * phnum).max(shoff + shentsize * shnum);
    let mut ph = vec![0u8; (phentsize * phnum) as usize];
    file.seek(SeekFrom::Start(phoff))?;
    file.read_exact(&mut ph)?;
    for h in ph.chunks_exact(phentsize.max(56) as usize) {
        end = end.max(u64_at(h, 8).saturating_add(u64_at(h, 32)));
    }
    // Sections (non-allocated ones, such as .symtab or .comment, lie outside every segment).
    let mut sh = vec![0u8; (shentsize * shnum) as usize];
    file.seek(SeekFrom::Start(shoff))?;
    file.read_exact(&mut sh)?;
    const SHT_NOBITS: u32 = 8;
    for h in sh.chunks_exact(shentsize.max(64) as usize) {
        if u32::from_le_bytes([h[4], h[5], h[6], h[7]]) != SHT_NOBITS {
            end = end.max(u64_at(h, 24).saturating_add(u64_at(h, 32)));
        }
    }
    Ok(Some(end))
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> Result<usize, std::io::Error> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// What `file` holds: not an ELF file, a plain executable, or a bundle whose trailer is valid; a
/// truncated or damaged bundle is an error saying so.
pub fn inspect(file: &mut File) -> Result<Contents, String> {
    let io = |e: std::io::Error| e.to_string();
    let len = file.metadata().map_err(io)?.len();
    let Some(elf_end) = elf_end(file).map_err(io)? else { return Ok(Contents::NotElf) };
    if len >= TRAILER_LEN as u64 {
        let mut t = [0u8; TRAILER_LEN];
        file.seek(SeekFrom::Start(len - TRAILER_LEN as u64)).map_err(io)?;
        file.read_exact(&mut t).map_err(io)?;
        if let Some(trailer) = Trailer::decode(&t, len)? {
            if trailer.model_offset < elf_end {
                return Err("the bundle was altered (its model overlaps the executable)".into());
            }
            return Ok(Contents::Bundle(trailer));
        }
    }
    if len > elf_end {
        return Err(format!(
            "{} bytes follow the executable's ELF image but no valid pinfer bundle trailer: \
             the bundle is truncated or damaged (make it again with `pinfer bundle`)",
            len - elf_end
        ));
    }
    Ok(Contents::Plain)
}

/// Checks the bundled model's header bytes (the GGUF up to its tensor data) against the trailer.
pub fn check_header(trailer: &Trailer, model: &[u8]) -> Result<(), String> {
    let header = usize::try_from(trailer.header_len).ok().and_then(|n| model.get(..n));
    match header {
        Some(h) if crc32fast::hash(h) == trailer.header_crc => Ok(()),
        _ => Err("the bundled model's header does not match its checksum: the bundle is damaged \
                  (make it again with `pinfer bundle`)"
            .into()),
    }
}

/// Whether the executable at `path` carries a model: a bundle, or bytes after its ELF image (a
/// damaged bundle, which loading then refuses by name).
pub fn carries_model(path: &Path) -> bool {
    File::open(path).is_ok_and(|mut f| !matches!(inspect(&mut f), Ok(Contents::Plain | Contents::NotElf)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailer_round_trips_and_refuses_damage_and_bad_extents() {
        let t =
            Trailer { flags: 1, model_offset: ALIGN * 3, model_len: 1000, header_len: 100, header_crc: 7 };
        let len = ALIGN * 3 + 1000 + TRAILER_LEN as u64;
        let bytes = t.encode();
        assert_eq!(Trailer::decode(&bytes, len), Ok(Some(t)));
        assert!(Trailer::decode(&bytes, len - 1).unwrap_err().contains("truncated"));
        let mut bad = bytes;
        bad[20] ^= 1;
        assert!(Trailer::decode(&bad, len).unwrap_err().contains("damaged"));
        let mut other = [0u8; TRAILER_LEN];
        other[..8].copy_from_slice(b"GGUFxxxx");
        assert_eq!(Trailer::decode(&other, len), Ok(None));
        let unaligned = Trailer { model_offset: 4096, ..t };
        assert!(Trailer::decode(&unaligned.encode(), 4096 + 1000 + TRAILER_LEN as u64).is_err());
    }
}
