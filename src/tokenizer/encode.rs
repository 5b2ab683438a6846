//! Encoding: special tokens cut out of the text, then each fragment by the vocabulary's algorithm
//! (SentencePiece, pre-tokenized words through BPE, or WordPiece), into the caller's slice; and
//! pairs of texts for cross-encoders.

use super::heap::NONE;
use super::{
    bpe, pretok, special, spm, wpm, Out, TokError, Tokenizer, VocabKind, SCRATCH, STACK_SCRATCH_WORDS,
};

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

    /// std: the token ids of `text` in a vector (its working memory allocated), with BOS/EOS as
    /// the model says when `add_special`.
    #[cfg(feature = "std")]
    pub fn encode_to_vec(
        &self,
        text: &str,
        parse_special: bool,
        add_special: bool,
    ) -> Result<std::vec::Vec<u32>, TokError> {
        let mut scratch = std::vec![0u32; self.scratch_words(text.len())];
        // About one token per byte at most, plus BOS, EOS and a space prefix; the tokenizer says
        // how many it needs if that is not enough.
        let mut ids = std::vec![0u32; text.len() + 4];
        let n = match self.encode_with_scratch(text, parse_special, add_special, &mut ids, &mut scratch) {
            Err(TokError::OutputTooSmall { needed, .. }) => {
                ids.resize(needed, 0);
                self.encode_with_scratch(text, parse_special, add_special, &mut ids, &mut scratch)
            }
            other => other,
        }?;
        ids.truncate(n);
        Ok(ids)
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
        if add_special && self.add_bos {
            sink.push(self.bos);
        }
        self.encode_text(text, parse_special, &mut sink, scratch)?;
        if add_special && self.end_token() != NONE {
            sink.push(self.end_token());
        }
        if sink.n > got {
            return Err(TokError::OutputTooSmall { needed: sink.n, got });
        }
        Ok(sink.n)
    }

    /// Encodes a pair of texts for a cross-encoder (a reranker's query and document) into `ids`,
    /// and the token type of each (0 for the first part, 1 for the second) into `types`; returns
    /// the number of tokens. WordPiece gives BERT's `[CLS] a [SEP] b [SEP]`, types 0 up to the first
    /// `[SEP]`, 1 after it (HF's pair template); the other kinds give `BOS a EOS b EOS` with BOS and
    /// EOS where the vocabulary adds them (llama.cpp's rerank prompt), the second part starting
    /// after the first EOS. `parse_special` as in [`Tokenizer::encode`]. `scratch` as for the longer
    /// text ([`Tokenizer::scratch_words`]); the shorter of `ids` and `types` limits the output
    /// ([`TokError::OutputTooSmall`]).
    pub fn encode_pair(
        &self,
        a: &str,
        b: &str,
        parse_special: bool,
        ids: &mut [u32],
        types: &mut [u32],
        scratch: &mut [u32],
    ) -> Result<usize, TokError> {
        let got = ids.len().min(types.len());
        let mut sink = Out { buf: &mut ids[..got], n: 0 };
        if self.add_bos {
            sink.push(self.bos);
        }
        let end = self.end_token();
        self.encode_text(a, parse_special, &mut sink, scratch)?;
        if end != NONE {
            sink.push(end);
        }
        let second = sink.n;
        self.encode_text(b, parse_special, &mut sink, scratch)?;
        if end != NONE {
            sink.push(end);
        }
        if sink.n > got {
            return Err(TokError::OutputTooSmall { needed: sink.n, got });
        }
        for (i, t) in types[..sink.n].iter_mut().enumerate() {
            *t = u32::from(i >= second);
        }
        Ok(sink.n)
    }

    /// The token that ends the text when special tokens are added: [SEP] for WordPiece, else EOS
    /// where the vocabulary adds it; NONE when there is none.
    fn end_token(&self) -> u32 {
        match self.kind {
            VocabKind::Wpm => self.sep,
            _ if self.add_eos => self.eos,
            _ => NONE,
        }
    }

    /// The tokens of `text` (special tokens cut out first), no BOS or EOS.
    fn encode_text(
        &self,
        text: &str,
        parse_special: bool,
        sink: &mut Out<'_>,
        scratch: &mut [u32],
    ) -> Result<(), TokError> {
        let too_small =
            TokError::ScratchTooSmall { needed: self.scratch_words(text.len()), got: scratch.len() };
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
                                sink,
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
                                bpe::encode_word(self, &piece.as_bytes()[c..d], scratch, sink).map_err(|e| {
                                    if e == SCRATCH {
                                        too_small.clone()
                                    } else {
                                        e
                                    }
                                })
                            })?;
                        }
                        VocabKind::SpmBpe => {
                            pretok::split_newline_runs(piece, &mut |c, d| {
                                bpe::encode_word_spm(self, &piece.as_bytes()[c..d], scratch, sink)
                                    .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })
                            })?;
                        }
                        VocabKind::Wpm => wpm::encode(self, piece, sink),
                    }
                    prev_special = false;
                }
            }
            Ok(())
        })
        .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })?;
        Ok(())
    }
}
