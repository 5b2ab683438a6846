// mtmd_dump: what llama.cpp's libmtmd makes of one image and one prompt, as JSON, for the vision
// goldens (tests/golden/vision). Built and run by scripts/mtmd_goldens.sh.
//
//   mtmd_dump --model M.gguf --mmproj P.gguf --image IMG --prompt TEXT [-n N] [-t THREADS] [--out FILE]
//             [--cmd "command line to record"]
//
// It follows llama-mtmd-cli -p (tools/mtmd/mtmd-cli.cpp, single turn, no --jinja): the image is loaded
// with mtmd_helper_bitmap_init_from_file, the media marker is prepended to the prompt when missing, the
// user message is formatted with the model's chat template (llama_chat_apply_template, the legacy
// path llama-mtmd-cli takes without --jinja), split on the marker and tokenized with
// mtmd_tokenize_from_parts (BOS added, special tokens parsed). Then every chunk is evaluated in order
// (text: mtmd_helper_eval_chunk_single; image: mtmd_encode_chunk, mtmd_get_output_embd,
// mtmd_helper_decode_image_chunk) and N tokens are decoded greedily (argmax of the last logits, first
// index on ties, stopping at an end-of-generation token).
//
// Dumped per image chunk: the preprocessed f32 tiles clip produced (libmtmd keeps them in the chunk's
// mtmd_image_tokens, which mtmd.h leaves opaque: image_tokens_view below mirrors the layout of that
// struct in tools/mtmd/mtmd.cpp at llama.cpp 0c1e570, checked against the public accessors at run
// time), the token grid, the decoder positions of each embedding, and the embeddings themselves.
// Pixel arrays are interleaved RGB, row-major (index (y*nx + x)*3 + c), normalised with the mmproj's
// image_mean/std. A tile is written in full when the image's tiles hold < 200k floats in all; else the
// first 4096 values of each; every tile also has per-channel float64 sums and sums of squares of all its
// values. Since clip resizes in u8 and normalises after, each value is (float(k)/255 - mean)/std for a
// k in 0..255: when that holds exactly (float32) for all of a tile, the k are written ("pixels_u8"),
// else the floats ("pixels"); the "_head" suffix marks a truncated array.

#include "clip-impl.h"   // clip_image_f32_batch (tools/mtmd)
#include "gguf.h"
#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// Same member order and types as struct mtmd_image_tokens in tools/mtmd/mtmd.cpp.
struct image_tokens_view {
    uint32_t nx;
    uint32_t ny;
    int pos_type;  // enum mtmd_pos_type: 0 normal, 1 M-RoPE, 2 HunyuanVL
    uint32_t image_idx;
    uint32_t n_temporal_merge;
    clip_image_f32_batch batch_f32;
    std::string id;
};

static void die(const char * msg) {
    fprintf(stderr, "mtmd_dump: %s\n", msg);
    exit(1);
}

struct json_out {
    std::string s;
    void raw(const std::string & t) { s += t; }
    void str(const std::string & t) {
        s += '"';
        for (unsigned char c : t) {
            switch (c) {
                case '"': s += "\\\""; break;
                case '\\': s += "\\\\"; break;
                case '\n': s += "\\n"; break;
                case '\r': s += "\\r"; break;
                case '\t': s += "\\t"; break;
                default:
                    if (c < 0x20) {
                        char b[8];
                        snprintf(b, sizeof b, "\\u%04x", c);
                        s += b;
                    } else {
                        s += (char) c;
                    }
            }
        }
        s += '"';
    }
    void key(const char * k) { str(k); s += ": "; }
    void num(double v) {
        char b[40];
        if (!std::isfinite(v)) {
            snprintf(b, sizeof b, "null");
        } else {
            snprintf(b, sizeof b, "%.17g", v);
        }
        s += b;
    }
    void f32(float v) {
        char b[40];
        if (!std::isfinite(v)) {
            snprintf(b, sizeof b, "null");
        } else {
            snprintf(b, sizeof b, "%.9g", v);  // round-trips a float32
        }
        s += b;
    }
    void i64(int64_t v) { s += std::to_string(v); }
    template <typename T> void ints(const T * p, size_t n) {
        s += '[';
        for (size_t i = 0; i < n; i++) {
            if (i) s += ", ";
            i64((int64_t) p[i]);
        }
        s += ']';
    }
    void floats(const float * p, size_t n) {
        s += '[';
        for (size_t i = 0; i < n; i++) {
            if (i) s += (i % 16 == 0) ? ",\n      " : ", ";
            f32(p[i]);
        }
        s += ']';
    }
};

static std::string token_piece(const llama_vocab * vocab, llama_token t) {
    char buf[256];
    int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, true);
    if (n < 0) {
        std::vector<char> big(-n);
        n = llama_token_to_piece(vocab, t, big.data(), big.size(), 0, true);
        return std::string(big.data(), n);
    }
    return std::string(buf, n);
}

int main(int argc, char ** argv) {
    std::string model_path, mmproj_path, image_path, prompt, out_path, cmd;
    int n_predict = 8;
    int n_threads = 2;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) die(("missing value for " + a).c_str());
            return argv[++i];
        };
        if (a == "--model" || a == "-m") model_path = next();
        else if (a == "--mmproj") mmproj_path = next();
        else if (a == "--image") image_path = next();
        else if (a == "--prompt" || a == "-p") prompt = next();
        else if (a == "-n") n_predict = atoi(next().c_str());
        else if (a == "-t") n_threads = atoi(next().c_str());
        else if (a == "--out") out_path = next();
        else if (a == "--cmd") cmd = next();
        else die(("unknown argument " + a).c_str());
    }
    if (model_path.empty() || mmproj_path.empty() || image_path.empty()) {
        die("usage: mtmd_dump --model M --mmproj P --image IMG --prompt TEXT [-n N] [-t T] [--out FILE]");
    }

    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("failed to load model");
    const llama_vocab * vocab = llama_model_get_vocab(model);

    // common_params defaults as llama-mtmd-cli has them: n_ctx 0 (the model's), n_batch 2048, n_ubatch 512
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 0;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    llama_context * lctx = llama_init_from_model(model, cp);
    if (!lctx) die("failed to create context");

    mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = false;
    mparams.print_timings = false;
    mparams.n_threads = n_threads;
    mtmd_context * mctx = mtmd_init_from_file(mmproj_path.c_str(), model, mparams);
    if (!mctx) die("failed to load mmproj");

    // the mmproj's normalisation, to write tiles as the u8 values they were normalised from
    float img_mean[3] = {0, 0, 0}, img_std[3] = {1, 1, 1};
    bool have_norm = false;
    {
        gguf_init_params gp = {true, nullptr};
        gguf_context * g = gguf_init_from_file(mmproj_path.c_str(), gp);
        if (g) {
            const int64_t km = gguf_find_key(g, "clip.vision.image_mean");
            const int64_t ks = gguf_find_key(g, "clip.vision.image_std");
            if (km >= 0 && ks >= 0 && gguf_get_arr_n(g, km) >= 3 && gguf_get_arr_n(g, ks) >= 3) {
                const float * m = (const float *) gguf_get_arr_data(g, km);
                const float * sd = (const float *) gguf_get_arr_data(g, ks);
                for (int c = 0; c < 3; c++) {
                    img_mean[c] = m[c];
                    img_std[c] = sd[c];
                }
                have_norm = true;
            }
            gguf_free(g);
        }
    }

    mtmd_helper_bitmap_wrapper bw = mtmd_helper_bitmap_init_from_file(mctx, image_path.c_str(), false,
                                                                      mtmd_helper_init_opt_default());
    if (!bw.bitmap) die("failed to load image");
    const uint32_t img_nx = mtmd_bitmap_get_nx(bw.bitmap);
    const uint32_t img_ny = mtmd_bitmap_get_ny(bw.bitmap);

    // the decoded RGB bitmap, summarised (it is what preprocessing starts from)
    double rgb_sum[3] = {0, 0, 0};
    {
        const unsigned char * d = mtmd_bitmap_get_data(bw.bitmap);
        const size_t n = (size_t) img_nx * img_ny;
        for (size_t i = 0; i < n; i++) {
            for (int c = 0; c < 3; c++) rgb_sum[c] += d[i * 3 + c];
        }
    }

    // prompt as llama-mtmd-cli -p builds it
    const std::string marker = mtmd_default_marker();
    std::string content = prompt;
    if (content.find(marker) == std::string::npos) {
        content = marker + content;
    }
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (!tmpl) die("model has no chat template");
    llama_chat_message msg = {"user", content.c_str()};
    std::vector<char> fbuf(content.size() * 2 + 4096);
    int32_t flen = llama_chat_apply_template(tmpl, &msg, 1, true, fbuf.data(), fbuf.size());
    if (flen < 0) die("llama_chat_apply_template failed");
    if ((size_t) flen > fbuf.size()) {
        fbuf.resize(flen);
        flen = llama_chat_apply_template(tmpl, &msg, 1, true, fbuf.data(), fbuf.size());
    }
    const std::string formatted(fbuf.data(), flen);

    std::vector<std::string> segments;
    {
        size_t start = 0, pos;
        while ((pos = formatted.find(marker, start)) != std::string::npos) {
            segments.push_back(formatted.substr(start, pos - start));
            start = pos + marker.size();
        }
        segments.push_back(formatted.substr(start));
    }
    if (segments.size() != 2) die("expected exactly one media marker in the formatted prompt");
    std::vector<mtmd_input_text> texts(segments.size());
    std::vector<mtmd_input_part> parts;
    for (size_t i = 0; i < segments.size(); i++) {
        texts[i] = {segments[i].data(), segments[i].size(), false, true};
        parts.push_back({&texts[i], nullptr});
        if (i == 0) parts.push_back({nullptr, bw.bitmap});
    }
    std::vector<const mtmd_input_part *> parts_ptr;
    for (auto & p : parts) parts_ptr.push_back(&p);

    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    if (mtmd_tokenize_from_parts(mctx, chunks, parts_ptr.data(), parts_ptr.size(), true) != 0) {
        die("mtmd_tokenize_from_parts failed");
    }

    const int n_embd = llama_model_n_embd_inp(model);
    json_out j;
    j.raw("{\n");
    j.raw("  "); j.key("llama_cpp"); j.str("0c1e570"); j.raw(",\n");
    j.raw("  "); j.key("command"); j.str(cmd); j.raw(",\n");
    {
        std::string b = image_path;
        size_t sl = b.find_last_of('/');
        if (sl != std::string::npos) b = b.substr(sl + 1);
        j.raw("  "); j.key("image"); j.str(b); j.raw(",\n");
    }
    j.raw("  "); j.key("width"); j.i64(img_nx); j.raw(", "); j.key("height"); j.i64(img_ny); j.raw(",\n");
    j.raw("  "); j.key("decoded_rgb_mean"); j.raw("[");
    for (int c = 0; c < 3; c++) {
        if (c) j.raw(", ");
        j.num(rgb_sum[c] / ((double) img_nx * img_ny));
    }
    j.raw("],\n");
    j.raw("  "); j.key("prompt"); j.str(prompt); j.raw(",\n");
    j.raw("  "); j.key("formatted_prompt"); j.str(formatted); j.raw(",\n");
    j.raw("  "); j.key("n_embd"); j.i64(n_embd); j.raw(",\n");
    j.raw("  "); j.key("image_mean"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.f32(img_mean[c]); } j.raw("], ");
    j.key("image_std"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.f32(img_std[c]); } j.raw("],\n");
    j.raw("  "); j.key("pixels_u8_meaning"); j.str("pixel = (float32(k) / 255.0f - image_mean[c]) / image_std[c], float32 arithmetic, c = index % 3"); j.raw(",\n");
    j.raw("  "); j.key("mrope"); j.raw(mtmd_decode_use_mrope(mctx) ? "true" : "false"); j.raw(",\n");
    j.raw("  "); j.key("chunks"); j.raw("[\n");

    llama_pos n_past = 0;
    const size_t n_chunks = mtmd_input_chunks_size(chunks);
    for (size_t ci = 0; ci < n_chunks; ci++) {
        const mtmd_input_chunk * chunk = mtmd_input_chunks_get(chunks, ci);
        const bool last = ci + 1 == n_chunks;
        j.raw(ci ? ",\n    {" : "    {");
        if (mtmd_input_chunk_get_type(chunk) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            size_t n_tok = 0;
            const llama_token * toks = mtmd_input_chunk_get_tokens_text(chunk, &n_tok);
            j.key("type"); j.str("text"); j.raw(", ");
            j.key("n_tokens"); j.i64(n_tok); j.raw(", ");
            j.key("pos_start"); j.i64(n_past); j.raw(",\n      ");
            j.key("tokens"); j.ints(toks, n_tok); j.raw(",\n      ");
            j.key("pieces"); j.raw("[");
            for (size_t i = 0; i < n_tok; i++) {
                if (i) j.raw(", ");
                j.str(token_piece(vocab, toks[i]));
            }
            j.raw("]}");
            llama_pos np = n_past;
            if (mtmd_helper_eval_chunk_single(mctx, lctx, chunk, n_past, 0, cp.n_batch, last, &np) != 0) {
                die("text chunk eval failed");
            }
            n_past = np;
            continue;
        }
        if (mtmd_input_chunk_get_type(chunk) != MTMD_INPUT_CHUNK_TYPE_IMAGE) die("unexpected chunk type");

        const mtmd_image_tokens * it = mtmd_input_chunk_get_tokens_image(chunk);
        const image_tokens_view * v = reinterpret_cast<const image_tokens_view *>(it);
        const size_t n_tok = mtmd_image_tokens_get_n_tokens(it);
        const llama_pos n_pos = mtmd_image_tokens_get_n_pos(it);
        // layout checks against the public accessors
        if (v->id != mtmd_image_tokens_get_id(it)) die("image_tokens_view layout mismatch (id)");
        const auto & entries = v->batch_f32.entries;
        if (entries.empty() || entries.size() > 1000) die("image_tokens_view layout mismatch (entries)");
        if (v->pos_type != 2 && v->n_temporal_merge <= 1 && (size_t) v->nx * v->ny * entries.size() != n_tok) {
            die("image_tokens_view layout mismatch (nx*ny*tiles != n_tokens)");
        }
        size_t total = 0;
        for (const auto & e : entries) {
            if (e.is_placeholder() || e.get_ro_buf().size() != (size_t) e.nx() * e.ny() * 3) {
                die("image_tokens_view layout mismatch (tile buffer)");
            }
            total += e.get_ro_buf().size();
        }
        const bool full = total < 200000;

        j.key("type"); j.str("image"); j.raw(", ");
        j.key("n_tokens"); j.i64(n_tok); j.raw(", ");
        j.key("n_pos"); j.i64(n_pos); j.raw(", ");
        j.key("pos_start"); j.i64(n_past); j.raw(", ");
        j.key("grid_nx"); j.i64(v->nx); j.raw(", ");
        j.key("grid_ny"); j.i64(v->ny); j.raw(", ");
        j.key("pos_type"); j.i64(v->pos_type); j.raw(", ");
        j.key("id"); j.str(v->id); j.raw(",\n      ");
        j.key("n_tiles"); j.i64(entries.size()); j.raw(", ");
        j.key("pixels_layout"); j.str("interleaved RGB, row-major: (y*nx + x)*3 + c"); j.raw(", ");
        j.key("pixels_full"); j.raw(full ? "true" : "false"); j.raw(",\n      ");
        j.key("tiles"); j.raw("[");
        for (size_t ti = 0; ti < entries.size(); ti++) {
            const auto & e = entries[ti];
            const auto & buf = e.get_ro_buf();
            double sum[3] = {0, 0, 0}, sq[3] = {0, 0, 0};
            float mn[3] = {INFINITY, INFINITY, INFINITY}, mx[3] = {-INFINITY, -INFINITY, -INFINITY};
            for (size_t i = 0; i < buf.size(); i++) {
                const int c = i % 3;
                sum[c] += buf[i];
                sq[c] += (double) buf[i] * buf[i];
                mn[c] = std::min(mn[c], buf[i]);
                mx[c] = std::max(mx[c], buf[i]);
            }
            j.raw(ti ? ",\n      {" : "\n      {");
            j.key("nx"); j.i64(e.nx()); j.raw(", ");
            j.key("ny"); j.i64(e.ny()); j.raw(", ");
            j.key("n_floats"); j.i64(buf.size()); j.raw(",\n       ");
            j.key("sum"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.num(sum[c]); } j.raw("], ");
            j.key("sum_sq"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.num(sq[c]); } j.raw("],\n       ");
            j.key("min"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.f32(mn[c]); } j.raw("], ");
            j.key("max"); j.raw("["); for (int c = 0; c < 3; c++) { if (c) j.raw(", "); j.f32(mx[c]); } j.raw("],\n       ");
            // clip resizes in u8 and normalises after: (float(k)/255 - mean[c]) / std[c] in float32.
            // When every value is exactly that for some k in 0..255, the k are written (pixels_u8).
            const size_t n_out = full ? buf.size() : std::min<size_t>(4096, buf.size());
            std::vector<int> ks(buf.size());
            bool as_u8 = have_norm;
            for (size_t i = 0; as_u8 && i < buf.size(); i++) {
                const int c = i % 3;
                const double guess = ((double) buf[i] * img_std[c] + img_mean[c]) * 255.0;
                bool hit = false;
                for (int k = std::max(0, (int) std::floor(guess) - 1); k <= std::min(255, (int) std::ceil(guess) + 1) && !hit; k++) {
                    const float f = ((float) k / 255.0f - img_mean[c]) / img_std[c];
                    if (f == buf[i]) {
                        ks[i] = k;
                        hit = true;
                    }
                }
                as_u8 = hit;
            }
            if (as_u8) {
                j.key(full ? "pixels_u8" : "pixels_u8_head");
                j.ints(ks.data(), n_out);
            } else {
                j.key(full ? "pixels" : "pixels_head");
                j.floats(buf.data(), n_out);
            }
            j.raw("}");
        }
        j.raw("],\n      ");

        j.key("decoder_pos"); j.raw("[");
        for (size_t i = 0; i < n_tok; i++) {
            mtmd_decoder_pos p = mtmd_image_tokens_get_decoder_pos(it, n_past, i);
            if (i) j.raw(i % 8 == 0 ? ",\n        " : ", ");
            j.raw("["); j.i64(p.t); j.raw(", "); j.i64(p.x); j.raw(", "); j.i64(p.y); j.raw("]");
        }
        j.raw("],\n      ");

        if (mtmd_encode_chunk(mctx, chunk) != 0) die("mtmd_encode_chunk failed");
        float * embd = mtmd_get_output_embd(mctx);
        double esum = 0, esq = 0;
        for (size_t i = 0; i < n_tok * (size_t) n_embd; i++) {
            esum += embd[i];
            esq += (double) embd[i] * embd[i];
        }
        j.key("embd_shape"); j.raw("["); j.i64(n_tok); j.raw(", "); j.i64(n_embd); j.raw("], ");
        j.key("embd_sum"); j.num(esum); j.raw(", ");
        j.key("embd_sum_sq"); j.num(esq); j.raw(",\n      ");
        j.key("embd"); j.floats(embd, n_tok * (size_t) n_embd);
        j.raw("}");

        llama_pos np = n_past;
        if (mtmd_helper_decode_image_chunk(mctx, lctx, chunk, embd, n_past, 0, cp.n_batch, &np, nullptr, nullptr) != 0) {
            die("image chunk decode failed");
        }
        n_past = np;
    }
    j.raw("\n  ],\n");
    j.raw("  "); j.key("n_past_after_prompt"); j.i64(n_past); j.raw(",\n");

    // greedy decoding
    std::vector<llama_token> gen;
    std::string text;
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_batch batch = llama_batch_init(1, 0, 1);
    for (int i = 0; i < n_predict; i++) {
        const float * logits = llama_get_logits_ith(lctx, -1);
        llama_token best = 0;
        for (llama_token t = 1; t < n_vocab; t++) {
            if (logits[t] > logits[best]) best = t;
        }
        gen.push_back(best);
        if (llama_vocab_is_eog(vocab, best)) break;
        text += token_piece(vocab, best);
        batch.n_tokens = 1;
        batch.token[0] = best;
        batch.pos[0] = n_past++;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        if (llama_decode(lctx, batch) != 0) die("decode failed");
    }
    llama_batch_free(batch);
    j.raw("  "); j.key("n_predict"); j.i64(n_predict); j.raw(",\n");
    j.raw("  "); j.key("greedy_ids"); j.ints(gen.data(), gen.size()); j.raw(",\n");
    j.raw("  "); j.key("greedy_text"); j.str(text); j.raw("\n");
    j.raw("}\n");

    if (out_path.empty()) {
        fwrite(j.s.data(), 1, j.s.size(), stdout);
    } else {
        FILE * f = fopen(out_path.c_str(), "wb");
        if (!f) die("cannot open output");
        fwrite(j.s.data(), 1, j.s.size(), f);
        fclose(f);
    }

    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bw.bitmap);
    mtmd_free(mctx);
    llama_free(lctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
