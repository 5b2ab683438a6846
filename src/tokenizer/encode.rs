//! Encoding: special tokens cut out of the text, then each fragment by the vocabulary's algorithm
//! (SentencePiece, or pre-tokenized words through BPE), into the caller's slice.

use super::{bpe, pretok, special, spm, Out, TokError, Tokenizer, VocabKind, SCRATCH, STACK_SCRATCH_WORDS};

impl Tokenizer<'_> {
    /// Encodes `text` into `out` and returns the number of tokens, with llama.cpp's rules:
    /// `parse_special` lets control tokens written in the text (`<|im_start|>`) become those tokens
    /// (user-defined tokens always do); `add_special` adds BOS and EOS where the vocabulary says so
    /// ([`Tokenizer::add_bos`], [`Tokenizer::add_eos`]).
    ///
    /// Working memory is [`STACK_SCRATCH_WORDS`] words on the stack: enough for words (BPE) or
    /// texts (SentencePiece) of about 1300 bytes. Longer input gives
    /// [`TokError::ScratchTooSmall`]; use [`Tokenizer::encode_with_scratch`] for it.
    pub fn encode(
        &self,
        text: &str,
        parse_special: bool,
        add_special: bool,
        out: &mut [u32],
    ) -> Result<usize, TokError> {
        let mut scratch = [0u32; STACK_SCRATCH_WORDS];
        self.encode_with_scratch(text, parse_special, add_special, out, &mut scratch)
    }

    /// [`Tokenizer::encode`] with caller working memory: [`Tokenizer::scratch_words`]`(text.len())`
    /// words are always enough, for any text.
    pub fn encode_with_scratch(
        &self,
        text: &str,
        parse_special: bool,
        add_special: bool,
        out: &mut [u32],
        scratch: &mut [u32],
    ) -> Result<usize, TokError> {
        let got = out.len();
        let mut sink = Out { buf: out, n: 0 };
        let too_small =
            TokError::ScratchTooSmall { needed: self.scratch_words(text.len()), got: scratch.len() };
        if add_special && self.add_bos {
            sink.push(self.bos);
        }
        let mut prev_special = true; // SentencePiece: a space goes in front of text that follows a special token
        special::for_each_fragment(self, text, parse_special, scratch, &mut |frag, scratch| {
            match frag {
                special::Fragment::Token(id) => {
                    sink.push(id);
                    prev_special = true;
                }
                special::Fragment::Text(a, b) => {
                    let piece = text.get(a..b).unwrap_or("");
                    match self.kind {
                        VocabKind::Spm => {
                            spm::encode(
                                self,
                                piece.as_bytes(),
                                self.add_space_prefix && prev_special,
                                scratch,
                                &mut sink,
                            )
                            .map_err(|e| {
                                if e == SCRATCH {
                                    too_small.clone()
                                } else {
                                    e
                                }
                            })?;
                        }
                        VocabKind::Bpe => {
                            pretok::split(self.pre, piece, &mut |c, d| {
                                bpe::encode_word(self, &piece.as_bytes()[c..d], scratch, &mut sink)
                                    .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })
                            })?;
                        }
                        VocabKind::SpmBpe => {
                            pretok::split_newline_runs(piece, &mut |c, d| {
                                bpe::encode_word_spm(self, &piece.as_bytes()[c..d], scratch, &mut sink)
                                    .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })
                            })?;
                        }
                    }
                    prev_special = false;
                }
            }
            Ok(())
        })
        .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })?;
        if add_special && self.add_eos {
            sink.push(self.eos);
        }
        if sink.n > got {
            return Err(TokError::OutputTooSmall { needed: sink.n, got });
        }
        Ok(sink.n)
    }
}
