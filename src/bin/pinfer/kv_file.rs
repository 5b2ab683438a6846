//! A saved KV cache: the tokens a sequence's cache holds and its cache rows, with what they must
//! match to be used again. The server's slot files (`POST /slots/{id}?action=save`) and
//! `generate --prompt-cache FILE` write it.
//!
//! Layout (little-endian): magic `PINFSLOT`, version u32, the model's identity (file size u64,
//! CRC32 of its GGUF header and its LoRA adapters' headers and scales u32), bytes per cached
//! position u32, layers u32, the cache's K and V
//! types (GGML type ids, u16 each), bytes of the recurrent states u32 (0 without recurrent layers),
//! token count u32, the tokens (u32 each), the cache rows then the recurrent states, and a CRC32 of
//! everything before it. A file that does not match is refused with the reason, never
//! loaded.

use std::path::Path;

const MAGIC: &[u8; 8] = b"PINFSLOT";
const VERSION: u32 = 3;
/// Magic, version, identity and token count.
const HEAD: usize = 8 + 4 + 8 + 6 * 4;

/// What a slot file must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub model_size: u64,
    pub header_crc: u32,
    /// `Session::save_sequence(_, 1)`'s length: bytes of one position in every layer.
    pub position_bytes: u32,
    pub layers: u32,
    /// The cache's K and V types (GGML type ids), `k << 16 | v`.
    pub kv_types: u32,
    /// Bytes of a sequence's recurrent states (after the rows of a non-empty sequence).
    pub state_bytes: u32,
}

impl Identity {
    /// What a file saved from `session`'s cache carries.
    pub fn of(session: &pinfer::session::Session) -> Self {
        let header = session.model_bytes().get(..session.gguf().data_start()).unwrap_or(&[]);
        // The LoRA adapters (their headers and scales) change every cached value: a file saved
        // with other adapters, or none, must not match. (With none, the CRC is the header's.)
        let mut crc = crc32fast::Hasher::new();
        crc.update(header);
        for a in session.engine().planned().model().adapters() {
            crc.update(a.bytes.get(..a.lora.data_start).unwrap_or(a.bytes));
            crc.update(&a.scale.to_le_bytes());
        }
        let types = session.kv_types();
        Self {
            model_size: session.model_bytes().len() as u64,
            header_crc: crc.finalize(),
            position_bytes: u32::try_from(session.sequence_bytes(2) - session.sequence_bytes(1))
                .unwrap_or(u32::MAX),
            layers: session.hparams().n_layer,
            kv_types: types.k.id() << 16 | types.v.id(),
            state_bytes: u32::try_from(2 * session.sequence_bytes(1) - session.sequence_bytes(2))
                .unwrap_or(u32::MAX),
        }
    }

    /// Bytes of the rows and states of `n` saved positions.
    fn rows_len(&self, n: usize) -> u64 {
        n as u64 * u64::from(self.position_bytes) + if n > 0 { u64::from(self.state_bytes) } else { 0 }
    }
}

pub fn encode(id: &Identity, tokens: &[u32], rows: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(40 + 4 * tokens.len() + rows.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&id.model_size.to_le_bytes());
    for v in [id.header_crc, id.position_bytes, id.layers, id.kv_types, id.state_bytes, tokens.len() as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(rows);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// `K q8_0, V f16` for an identity's `kv_types`.
fn types_named(kv_types: u32) -> String {
    use pinfer::quant::{GgmlType, Lowercase};
    let name =
        |id: u32| GgmlType::from_u32(id).map_or(format!("type {id}"), |t| Lowercase(t.name()).to_string());
    format!("K {}, V {}", name(kv_types >> 16), name(kv_types & 0xffff))
}

/// The tokens and cache rows of a slot file made for `id`, or why it cannot be used.
pub fn decode<'b>(id: &Identity, bytes: &'b [u8]) -> Result<(Vec<u32>, &'b [u8]), String> {
    let head = HEAD;
    if bytes.len() < head + 4 || &bytes[..8] != MAGIC {
        return Err("not a pinfer slot file".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err("damaged (checksum mismatch)".into());
    }
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap_or([0; 4]));
    if u32_at(8) != VERSION {
        return Err(format!("slot file version {} (this pinfer reads {VERSION})", u32_at(8)));
    }
    let model_size = u64::from_le_bytes(body[12..20].try_into().unwrap_or([0; 8]));
    let saved = Identity {
        model_size,
        header_crc: u32_at(20),
        position_bytes: u32_at(24),
        layers: u32_at(28),
        kv_types: u32_at(32),
        state_bytes: u32_at(36),
    };
    if saved != *id {
        let same_model =
            Identity { kv_types: id.kv_types, position_bytes: id.position_bytes, ..saved } == *id;
        if same_model && saved.kv_types != id.kv_types {
            return Err(format!(
                "saved with another KV cache type ({}; this run uses {})",
                types_named(saved.kv_types),
                types_named(id.kv_types)
            ));
        }
        return Err("saved from another model, LoRA adapters or cache layout".into());
    }
    let n = u32_at(40) as usize;
    let rows_at = n.checked_mul(4).and_then(|b| b.checked_add(head)).filter(|&e| e <= body.len());
    let Some(rows_at) = rows_at else { return Err("truncated".into()) };
    let tokens =
        body[head..rows_at].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let rows = &body[rows_at..];
    if rows.len() as u64 != id.rows_len(n) {
        return Err("truncated".into());
    }
    Ok((tokens, rows))
}

/// Bytes of a slot file made for `id` holding `n_tokens` positions.
pub fn encoded_len(n_tokens: usize, id: &Identity) -> u64 {
    HEAD as u64 + 4 + n_tokens as u64 * 4 + id.rows_len(n_tokens)
}

/// Reads and decodes the slot file at `path` made for `id`, with at most `n_ctx` tokens (a larger
/// file, say a stray big one in the directory, is refused before it is read).
pub fn read(path: &Path, id: &Identity, n_ctx: usize) -> Result<(Vec<u32>, Vec<u8>), String> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let size = std::fs::metadata(path).map_err(|e| format!("{name}: {e}"))?.len();
    if size > encoded_len(n_ctx, id) {
        return Err(format!("{name}: {size} bytes, more than a slot file of this server holds"));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("{name}: {e}"))?;
    let (tokens, rows) = decode(id, &bytes).map_err(|e| format!("{name}: {e}"))?;
    Ok((tokens, rows.to_vec()))
}

/// Whether `path` may be replaced by a KV file: it does not exist, is empty, or is one (starts
/// with the magic). Anything else (a model given by mistake, say) is never overwritten.
pub fn replaceable(path: &Path) -> bool {
    use std::io::Read;
    let Ok(mut file) = std::fs::File::open(path) else { return !path.exists() };
    let mut head = [0u8; 8];
    match file.read(&mut head) {
        Ok(0) => true,
        Ok(_) => &head == MAGIC,
        Err(_) => false,
    }
}

/// Writes `bytes` to `path` through a temporary file renamed over it: a failed write leaves no
/// partial file.
pub fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // (The output's errors name the file already.)
    let mut out = pinfer::output_file::OutputFile::create(path, &[]).map_err(|e| e.to_string())?;
    let mut file = out.file();
    file.write_all(bytes).map_err(|e| format!("{name}: {e}"))?;
    out.commit().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model's identity with `state_bytes` of recurrent states.
    fn identity(state_bytes: u32) -> Identity {
        Identity {
            model_size: 1000,
            header_crc: 7,
            position_bytes: 8,
            layers: 2,
            kv_types: 1 << 16 | 1,
            state_bytes,
        }
    }

    #[test]
    fn a_slot_file_round_trips_and_refuses_what_does_not_match() {
        let id = identity(0);
        let rows: Vec<u8> = (0..24).collect();
        let bytes = encode(&id, &[5, 6, 7], &rows);
        let (tokens, got) = decode(&id, &bytes).unwrap();
        assert_eq!((tokens, got), (vec![5, 6, 7], &rows[..]));
        assert_eq!(bytes.len() as u64, encoded_len(3, &id));
        let other = Identity { header_crc: 8, ..id };
        assert!(decode(&other, &bytes).unwrap_err().contains("another model"));
        let mut flipped = bytes.clone();
        flipped[49] ^= 1;
        assert!(decode(&id, &flipped).unwrap_err().contains("checksum"));
        assert!(decode(&id, &bytes[..30]).is_err());
        assert!(decode(&id, b"GGUF and more bytes than a header holds, and more").is_err());
    }

    #[test]
    fn recurrent_states_follow_the_rows_once() {
        let id = identity(12);
        let rows: Vec<u8> = (0..24 + 12).collect();
        let bytes = encode(&id, &[5, 6, 7], &rows);
        assert_eq!(decode(&id, &bytes).unwrap().1, &rows[..]);
        assert_eq!(bytes.len() as u64, encoded_len(3, &id));
        // Rows without the states, or states of another size, are refused.
        assert!(decode(&id, &encode(&id, &[5, 6, 7], &rows[..24])).unwrap_err().contains("truncated"));
        let other = Identity { state_bytes: 16, ..id };
        assert!(decode(&other, &bytes).is_err());
        assert_eq!(encoded_len(0, &id), HEAD as u64 + 4);
    }
}
