/* pinfer's C ABI: run GGUF models from C and C++ (link libpinfer_capi.a, built by
 * `cargo build --release -p pinfer-capi`, with -lpthread -ldl -lm).
 *
 * Every function returns a pinfer_status and writes a NUL-terminated message into `err`
 * (`err_len` bytes; NULL or 0 for none): empty on success, what is wrong otherwise. Nothing
 * unwinds into the caller. A NULL, freed or wrong-kind handle is PINFER_ERR_HANDLE; NULL
 * pointers and bad lengths are PINFER_ERR_ARGUMENT. A context borrows its model: free the
 * contexts first. One handle is never used from two threads at once. Text is UTF-8.
 *
 * This file is checked against capi/src/lib.rs by capi/tests/c_abi.rs (same functions, same
 * parameter types, same struct fields, same status and end values). */
#ifndef PINFER_H
#define PINFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pinfer_status {
    PINFER_OK = 0,
    PINFER_ERR_ARGUMENT = 1,     /* a NULL pointer, a bad length or value */
    PINFER_ERR_HANDLE = 2,       /* not a live handle of the kind the function takes */
    PINFER_ERR_ORDER = 3,        /* logits before a decode, a model freed before its contexts */
    PINFER_ERR_IO = 4,           /* the file could not be read */
    PINFER_ERR_MODEL = 5,        /* not a model pinfer runs */
    PINFER_ERR_MEMORY = 6,       /* not enough memory */
    PINFER_ERR_CONTEXT_FULL = 7, /* the tokens do not fit the context */
    PINFER_ERR_BUFFER = 8,       /* the output buffer is too small: the size needed is written */
    PINFER_ERR_TOKENIZER = 9,    /* text or tokens could not be converted */
    PINFER_ERR_INTERNAL = 10     /* a bug in pinfer */
} pinfer_status;

typedef enum pinfer_end {
    PINFER_END_NONE = 0,              /* not ended: call pinfer_generate_step again */
    PINFER_END_END_OF_GENERATION = 1, /* an end-of-generation token (not passed on) */
    PINFER_END_STOP_STRING = 2,       /* a stop string appeared (not passed on) */
    PINFER_END_CONTEXT_FULL = 3       /* the context is full */
} pinfer_end;

typedef struct pinfer_model pinfer_model;
typedef struct pinfer_context pinfer_context;
typedef struct pinfer_sampler pinfer_sampler;

typedef struct pinfer_model_info {
    uint32_t n_vocab;
    uint32_t n_ctx_train;
    uint32_t n_embd;
    uint32_t n_layer;
    int32_t bos; /* -1: none */
    int32_t eos; /* -1: none */
    char arch[32];
} pinfer_model_info;

typedef struct pinfer_context_params {
    uint32_t n_ctx;     /* positions; 0: the model's training context, at most 4096 */
    uint32_t n_batch;   /* most tokens per engine step */
    uint32_t n_threads; /* worker threads, the caller included */
} pinfer_context_params;

typedef struct pinfer_sampler_params {
    float temperature; /* 0: greedy */
    uint32_t top_k;
    float top_p;
    float min_p;
    float repeat_penalty;
    uint32_t repeat_last_n;
    float frequency_penalty;
    float presence_penalty;
    uint64_t seed;
} pinfer_sampler_params;

typedef struct pinfer_chat_message {
    const char *role; /* "system", "user" or "assistant" */
    const char *content;
} pinfer_chat_message;

/* Models. open_file maps the file; open_bytes copies the bytes (the buffer may be freed after). */
pinfer_status pinfer_model_open_file(const char *path, pinfer_model **model, char *err, size_t err_len);
pinfer_status pinfer_model_open_bytes(const uint8_t *bytes, size_t len, pinfer_model **model, char *err, size_t err_len);
pinfer_status pinfer_model_free(pinfer_model *model, char *err, size_t err_len);
pinfer_status pinfer_model_get_info(const pinfer_model *model, pinfer_model_info *info, char *err, size_t err_len);

/* Contexts. pinfer_plan: the bytes a context with these parameters takes beside the model file. */
pinfer_status pinfer_context_default_params(pinfer_context_params *params, char *err, size_t err_len);
pinfer_status pinfer_plan(const pinfer_model *model, const pinfer_context_params *params, size_t *bytes, char *err, size_t err_len);
pinfer_status pinfer_context_new(pinfer_model *model, const pinfer_context_params *params, pinfer_context **context, char *err, size_t err_len);
pinfer_status pinfer_context_free(pinfer_context *context, char *err, size_t err_len);
pinfer_status pinfer_context_reset(pinfer_context *context, char *err, size_t err_len);
pinfer_status pinfer_context_n_past(const pinfer_context *context, size_t *n_past, char *err, size_t err_len);

/* Text. Output sizes go to n_tokens / text_len; a buffer too small gives PINFER_ERR_BUFFER with
 * the size needed there. Detokenized and chat text is not NUL-terminated. */
pinfer_status pinfer_tokenize(const pinfer_model *model, const char *text, size_t text_len, int add_special, int parse_special, uint32_t *tokens, size_t capacity, size_t *n_tokens, char *err, size_t err_len);
pinfer_status pinfer_detokenize(const pinfer_model *model, const uint32_t *tokens, size_t n_tokens, int special, char *text, size_t capacity, size_t *text_len, char *err, size_t err_len);
pinfer_status pinfer_token_is_eog(const pinfer_model *model, uint32_t token, int *is_eog, char *err, size_t err_len);
pinfer_status pinfer_chat_apply(const pinfer_model *model, const pinfer_chat_message *messages, size_t n_messages, int add_generation_prompt, char *text, size_t capacity, size_t *text_len, char *err, size_t err_len);

/* Decoding: tokens after the context's; then the last token's logits (owned by the context,
 * valid until its next decode, reset or free). */
pinfer_status pinfer_decode(pinfer_context *context, const uint32_t *tokens, size_t n_tokens, char *err, size_t err_len);
pinfer_status pinfer_logits(const pinfer_context *context, const float **logits, size_t *n_vocab, char *err, size_t err_len);

/* Sampling: llama.cpp's chain and defaults; temperature 0 is greedy. */
pinfer_status pinfer_sampler_default_params(pinfer_sampler_params *params, char *err, size_t err_len);
pinfer_status pinfer_sampler_new(const pinfer_sampler_params *params, pinfer_sampler **sampler, char *err, size_t err_len);
pinfer_status pinfer_sample(pinfer_sampler *sampler, const pinfer_context *context, uint32_t *token, char *err, size_t err_len);
pinfer_status pinfer_sampler_free(pinfer_sampler *sampler, char *err, size_t err_len);

/* Generation, one token a call: begin after decoding the prompt (the sampler chain of `params`;
 * `stops`: stop strings, each ended by a NUL, `stops_len` bytes in all, NULL and 0 for none), then
 * each step evaluates the last token, samples the next and writes the text now complete (whole
 * UTF-8 characters, possibly none; text that may begin a stop string is held back; not
 * NUL-terminated) into `piece`, the token into `token` (UINT32_MAX when the stream ended without
 * one) and why the stream ended into `end`. A piece too large for `capacity` is PINFER_ERR_BUFFER
 * with its length in piece_len, and the next call gives the same step again. A decode or a reset
 * ends the stream. */
pinfer_status pinfer_generate_begin(pinfer_context *context, const pinfer_sampler_params *params, const char *stops, size_t stops_len, char *err, size_t err_len);
pinfer_status pinfer_generate_step(pinfer_context *context, uint32_t *token, char *piece, size_t capacity, size_t *piece_len, pinfer_end *end, char *err, size_t err_len);
/* Ends a stream the caller stops (its own limit): the text still held back goes to `piece` (an
 * incomplete character as U+FFFD). The last token taken was not evaluated: decode it to go on. */
pinfer_status pinfer_generate_finish(pinfer_context *context, char *piece, size_t capacity, size_t *piece_len, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* PINFER_H */
