/* Byte-level BPE for the tiktoken-style pre-tokenizer patterns, in one C call per request.
 *
 * The pre-tokenizer regex of each supported family is implemented as a hand-written scanner over
 * the text's UTF-8 bytes: a class table (one byte per code point: letter, number, mark, White_Space,
 * unassigned), built by Python from `unicodedata`, replaces the regex engine. Every piece the
 * scanner yields is looked up whole in the vocabulary (tiktoken does the same) and otherwise merged
 * by rank, lowest rank first, leftmost first among equal ranks. Added tokens are split out first,
 * leftmost and longest first, and the text between them is scanned on its own.
 *
 * Two scanners cover the patterns (see dpu_tokenizer/bytelevel.py):
 *   gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *           and, with single digits, \p{N} first and \s+(?![^\s\p{N}]) for the lookahead;
 *   llama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 *           | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *           with the digit run length (3 or 1) and the letter class (\p{L}, or [\p{L}\p{M}]) as
 *           parameters.
 *
 * `encode` returns None, and the caller uses its exact fallback, whenever this path cannot vouch
 * for the result: a code point unassigned in the class table (the reference regex engine may know
 * it), a byte the vocabulary lacks, or text that is not valid UTF-8 (lone surrogates). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CL_L 1u
#define CL_N 2u
#define CL_M 4u
#define CL_WS 8u
#define CL_UNKNOWN 16u

#define NO_RANK UINT32_MAX
#define NO_ID UINT32_MAX
#define SMALL_PIECE 64 /* longer pieces are merged with a heap instead of rescanning the pairs */
#define N_CODE_POINTS 0x110000
#define RELEASE_GIL_BYTES 16384 /* longer texts are encoded without holding the GIL */

enum { SCAN_GPT2 = 0, SCAN_LLAMA3 = 1 };
/* FAILED while encoding means out of memory, with no Python error set: encoding may run without
 * the GIL. While splitting (GIL held) it means a Python error is set. */
enum { OK = 0, UNSUPPORTED = 1, FAILED = -1 };

typedef struct {
  uint32_t off, len, rank, id;
} Entry;

typedef struct {
  uint32_t tag, entry; /* entry is an index into entries plus one; 0 marks an empty slot */
} Slot;

typedef struct {
  uint32_t off, len, id;
  uint8_t first; /* its first byte */
} Added;

typedef struct {
  // clang-format off
  PyObject_HEAD
  int ready;
  // clang-format on
  int scan;
  int digits;         /* gpt2: 1 when every digit is its own piece; llama3: longest digit run */
  int fold_case;      /* contractions match case-insensitively (and 's matches U+017F) */
  uint8_t letter;     /* class bits of a letter run */
  uint8_t punct_stop; /* class bits that end a punctuation run */
  PyObject *classes;  /* bytes, one class byte per code point */
  const uint8_t *cls;
  uint8_t bad_byte[256];
  int any_bad;
  uint8_t *arena; /* the vocabulary's token bytes */
  Entry *entries;
  Slot *slots;
  uint64_t mask;
  uint32_t byte_id[256];
  uint8_t *added_text;
  Added *added; /* grouped by first byte, longest first within a group */
  Py_ssize_t n_added;
  uint32_t added_lo[256], added_hi[256];
  uint8_t added_len1[256];  /* some added token is this single byte */
  uint8_t added_pair[8192]; /* bit set: some added token starts with these two bytes */
  PyObject **ids;           /* one int object per id, shared by every list returned */
  Py_ssize_t n_ids;
} Encoder;

/* -- growable id buffer ---------------------------------------------------------------------- */

typedef struct {
  uint32_t *v;
  size_t n, cap;
  uint32_t local[512];
} IdBuf;

static void buf_init(IdBuf *b) {
  b->v = b->local;
  b->n = 0;
  b->cap = sizeof b->local / sizeof b->local[0];
}

static void buf_free(IdBuf *b) {
  if (b->v != b->local) PyMem_RawFree(b->v);
}

static int buf_grow(IdBuf *b) {
  size_t cap = b->cap * 2;
  uint32_t *v = b->v == b->local ? PyMem_RawMalloc(cap * sizeof *v) : PyMem_RawRealloc(b->v, cap * sizeof *v);
  if (v == NULL) return FAILED;
  if (b->v == b->local) memcpy(v, b->local, b->n * sizeof *v);
  b->v = v;
  b->cap = cap;
  return OK;
}

static inline int buf_push(IdBuf *b, uint32_t id) {
  if (b->n == b->cap && buf_grow(b) != OK) return FAILED;
  b->v[b->n++] = id;
  return OK;
}

/* -- vocabulary hash table ------------------------------------------------------------------- */

static inline uint64_t hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t v = 0;
    for (size_t k = 0; k < n; k++) v |= (uint64_t)p[k] << (8 * k);
    h = (h ^ v) * 0x94D049BB133111EBull;
  }
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h;
}

static inline const Entry *find(const Encoder *e, const uint8_t *p, size_t n) {
  uint64_t h = hash_bytes(p, n);
  uint32_t tag = (uint32_t)(h >> 32);
  for (uint64_t i = h & e->mask;; i = (i + 1) & e->mask) {
    const Slot *s = &e->slots[i];
    if (s->entry == 0) return NULL;
    if (s->tag == tag) {
      const Entry *en = &e->entries[s->entry - 1];
      if (en->len == n && memcmp(e->arena + en->off, p, n) == 0) return en;
    }
  }
}

/* -- character classes --------------------------------------------------------------------- */

/* The code point at s[i] and its UTF-8 width; the text is valid UTF-8 (it comes from a str). */
static inline uint32_t decode_at(const uint8_t *s, Py_ssize_t i, int *w) {
  uint8_t b = s[i];
  if (b < 0x80) {
    *w = 1;
    return b;
  }
  if (b < 0xE0) {
    *w = 2;
    return ((uint32_t)(b & 0x1F) << 6) | (s[i + 1] & 0x3F);
  }
  if (b < 0xF0) {
    *w = 3;
    return ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
  }
  *w = 4;
  return ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(s[i + 1] & 0x3F) << 12) | ((uint32_t)(s[i + 2] & 0x3F) << 6) |
         (s[i + 3] & 0x3F);
}

static inline uint8_t class_at(const Encoder *e, const uint8_t *s, Py_ssize_t i, int *w) {
  if (s[i] < 0x80) {
    *w = 1;
    return e->cls[s[i]];
  }
  return e->cls[decode_at(s, i, w)];
}

/* End of the run from i of chars whose class has a bit of `any`. */
static inline Py_ssize_t run_any(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n, uint8_t any) {
  int w;
  while (i < n && (class_at(e, s, i, &w) & any)) i += w;
  return i;
}

/* End of the run from i of chars whose class has no bit of `stop`. */
static inline Py_ssize_t run_none(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n, uint8_t stop) {
  int w;
  while (i < n && !(class_at(e, s, i, &w) & stop)) i += w;
  return i;
}

static inline Py_ssize_t newlines_after(const uint8_t *s, Py_ssize_t i, Py_ssize_t n) {
  while (i < n && (s[i] == '\r' || s[i] == '\n')) i++;
  return i;
}

/* -- scanners ------------------------------------------------------------------------------- */

/* End of a contraction whose apostrophe ends at j, or 0. */
static Py_ssize_t contraction(const Encoder *e, const uint8_t *s, Py_ssize_t j, Py_ssize_t n) {
  uint8_t a = s[j];
  uint8_t b = j + 1 < n ? s[j + 1] : 0;
  if (e->fold_case) {
    if (a == 0xC5 && b == 0xBF) return j + 2; /* U+017F LATIN SMALL LETTER LONG S folds to s */
    if (a >= 'A' && a <= 'Z') a += 32;
    if (b >= 'A' && b <= 'Z') b += 32;
  }
  switch (a) {
    case 's':
    case 't':
    case 'm':
    case 'd':
      return j + 1;
    case 'r':
    case 'v':
      return b == 'e' ? j + 2 : 0;
    case 'l':
      return b == 'l' ? j + 2 : 0;
    default:
      return 0;
  }
}

/* A whitespace run from i (s[i] is whitespace): its end, the start of its last char, its last
 * \r or \n (-1 when none). */
static inline Py_ssize_t space_run(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n, Py_ssize_t *last,
                                   Py_ssize_t *newline) {
  int w;
  *last = i;
  *newline = -1;
  while (i < n && (class_at(e, s, i, &w) & CL_WS)) {
    if (s[i] == '\r' || s[i] == '\n') *newline = i;
    *last = i;
    i += w;
  }
  return i;
}

/* End of the piece starting at i (< n), or -1 for a char this path cannot classify. */
static Py_ssize_t piece_llama3(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n) {
  int w, w2;
  uint32_t c = decode_at(s, i, &w);
  uint8_t k = e->cls[c];
  Py_ssize_t j = i + w;
  if (k & CL_UNKNOWN) return -1;
  if (c == '\'' && j < n) {
    Py_ssize_t end = contraction(e, s, j, n);
    if (end) return end;
  }
  if (k & e->letter) return run_any(e, s, j, n, e->letter);
  if (!(k & CL_N) && c != '\r' && c != '\n' && j < n && (class_at(e, s, j, &w2) & e->letter))
    return run_any(e, s, j + w2, n, e->letter); /* [^\r\n\p{L}\p{N}]?\p{L}+ */
  if (k & CL_N) {
    for (int count = 1; count < e->digits && j < n && (class_at(e, s, j, &w2) & CL_N); count++) j += w2;
    return j;
  }
  if (!(k & e->punct_stop)) return newlines_after(s, run_none(e, s, j, n, e->punct_stop), n);
  if (c == ' ' && j < n && !(class_at(e, s, j, &w2) & e->punct_stop))
    return newlines_after(s, run_none(e, s, j + w2, n, e->punct_stop), n);
  Py_ssize_t last, newline, end = space_run(e, s, i, n, &last, &newline);
  if (newline >= 0) return newline + 1;  /* \s*[\r\n]+ */
  if (end >= n || last == i) return end; /* \s+(?!\S) at the end, or \s+ of one char */
  return last;                           /* \s+(?!\S): the run less its last char */
}

static Py_ssize_t piece_gpt2(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n) {
  int w, w2;
  uint32_t c = decode_at(s, i, &w);
  uint8_t k = e->cls[c];
  Py_ssize_t j = i + w;
  if (k & CL_UNKNOWN) return -1;
  if ((k & CL_N) && e->digits) return j;
  if (c == '\'' && j < n) {
    Py_ssize_t end = contraction(e, s, j, n);
    if (end) return end;
  }
  if (c == ' ' && j < n) { /* " ?" before a letter, number or punctuation run */
    uint8_t k2 = class_at(e, s, j, &w2);
    if (!(k2 & (CL_WS | CL_UNKNOWN)) && !((k2 & CL_N) && e->digits)) {
      k = k2;
      j += w2;
    }
  }
  if (k & CL_L) return run_any(e, s, j, n, CL_L);
  if (k & CL_N) return run_any(e, s, j, n, CL_N);
  if (!(k & CL_WS)) return run_none(e, s, j, n, CL_WS | CL_L | CL_N | CL_UNKNOWN);
  Py_ssize_t last, newline, end = space_run(e, s, i, n, &last, &newline);
  if (end >= n) return end;
  if (e->digits && (class_at(e, s, end, &w2) & CL_N)) return end; /* \s+(?![^\s\p{N}]) */
  return last > i ? last : end;
}

/* -- merging ------------------------------------------------------------------------------- */

static inline void pair_of(const Encoder *e, const uint8_t *p, uint32_t from, uint32_t to, uint32_t *rank,
                           uint32_t *id) {
  const Entry *en = find(e, p + from, to - from);
  *rank = en ? en->rank : NO_RANK;
  *id = en ? en->id : NO_ID;
}

/* Rank BPE of a short piece: tiktoken's loop, rescanning the pairs for the lowest rank. */
static int merge_small(const Encoder *e, const uint8_t *p, int len, IdBuf *out) {
  uint32_t start[SMALL_PIECE + 1], part[SMALL_PIECE], rank[SMALL_PIECE], pid[SMALL_PIECE];
  int m = len;
  for (int i = 0; i < len; i++) {
    start[i] = (uint32_t)i;
    part[i] = e->byte_id[p[i]];
  }
  start[len] = (uint32_t)len;
  for (int i = 0; i + 1 < m; i++) pair_of(e, p, start[i], start[i + 2], &rank[i], &pid[i]);
  while (m > 1) {
    uint32_t best = NO_RANK;
    int b = -1;
    for (int i = 0; i + 1 < m; i++)
      if (rank[i] < best) {
        best = rank[i];
        b = i;
      }
    if (b < 0) break;
    part[b] = pid[b];
    memmove(start + b + 1, start + b + 2, (size_t)(m - b - 1) * sizeof start[0]);
    memmove(part + b + 1, part + b + 2, (size_t)(m - b - 2) * sizeof part[0]);
    if (m - b - 3 > 0) {
      memmove(rank + b + 1, rank + b + 2, (size_t)(m - b - 3) * sizeof rank[0]);
      memmove(pid + b + 1, pid + b + 2, (size_t)(m - b - 3) * sizeof pid[0]);
    }
    m--;
    if (b > 0) pair_of(e, p, start[b - 1], start[b + 1], &rank[b - 1], &pid[b - 1]);
    if (b + 1 < m) pair_of(e, p, start[b], start[b + 2], &rank[b], &pid[b]);
  }
  for (int i = 0; i < m; i++)
    if (buf_push(out, part[i]) != OK) return FAILED;
  return OK;
}

typedef struct {
  uint32_t rank, pos, gen, id;
} HeapItem;

static inline int heap_less(const HeapItem *a, const HeapItem *b) {
  return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(HeapItem *h, size_t *n, HeapItem item) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t up = (i - 1) / 2;
    if (!heap_less(&item, &h[up])) break;
    h[i] = h[up];
    i = up;
  }
  h[i] = item;
}

static HeapItem heap_pop(HeapItem *h, size_t *n) {
  HeapItem top = h[0], last = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
    if (!heap_less(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n) h[i] = last;
  return top;
}

/* The same merges for a long piece: parts in a linked list, candidate pairs in a heap ordered by
 * (rank, position); a pair is stale once either of its parts changed (its generation moved on). */
static int merge_large(const Encoder *e, const uint8_t *p, uint32_t len, IdBuf *out) {
  uint32_t *next = PyMem_RawMalloc(len * sizeof *next), *prev = PyMem_RawMalloc(len * sizeof *prev);
  uint32_t *gen = PyMem_RawMalloc(len * sizeof *gen), *part = PyMem_RawMalloc(len * sizeof *part);
  HeapItem *heap = PyMem_RawMalloc(3 * (size_t)len * sizeof *heap);
  int rc = OK;
  if (!next || !prev || !gen || !part || !heap) {
    rc = FAILED;
    goto done;
  }
  size_t n_heap = 0;
  for (uint32_t i = 0; i < len; i++) {
    next[i] = i + 1;
    prev[i] = i - 1; /* wraps to UINT32_MAX for the first part */
    gen[i] = 0;
    part[i] = e->byte_id[p[i]];
  }
  for (uint32_t i = 0; i + 1 < len; i++) {
    HeapItem it = {0, i, 0, 0};
    pair_of(e, p, i, i + 2, &it.rank, &it.id);
    if (it.rank != NO_RANK) heap_push(heap, &n_heap, it);
  }
  while (n_heap) {
    HeapItem it = heap_pop(heap, &n_heap);
    uint32_t a = it.pos;
    if (gen[a] != it.gen) continue; /* stale, or `a` was merged into its left neighbour */
    uint32_t b = next[a];
    part[a] = it.id;
    next[a] = next[b];
    if (next[a] < len) prev[next[a]] = a;
    gen[b] = UINT32_MAX; /* b is gone: every pair it starts is stale */
    gen[a]++;
    if (a > 0) {
      uint32_t l = prev[a];
      gen[l]++;
      HeapItem left = {0, l, gen[l], 0};
      pair_of(e, p, l, next[a], &left.rank, &left.id);
      if (left.rank != NO_RANK) heap_push(heap, &n_heap, left);
    }
    if (next[a] < len) {
      HeapItem right = {0, a, gen[a], 0};
      pair_of(e, p, a, next[next[a]], &right.rank, &right.id);
      if (right.rank != NO_RANK) heap_push(heap, &n_heap, right);
    }
  }
  for (uint32_t i = 0; i < len; i = next[i])
    if (buf_push(out, part[i]) != OK) {
      rc = FAILED;
      break;
    }
done:
  PyMem_RawFree(next);
  PyMem_RawFree(prev);
  PyMem_RawFree(gen);
  PyMem_RawFree(part);
  PyMem_RawFree(heap);
  return rc;
}

static inline int emit_piece(const Encoder *e, const uint8_t *p, Py_ssize_t len, IdBuf *out) {
  const Entry *en = find(e, p, (size_t)len);
  if (en != NULL) return buf_push(out, en->id);
  if (len <= SMALL_PIECE) return merge_small(e, p, (int)len, out);
  if (len >= (Py_ssize_t)UINT32_MAX / 4) return UNSUPPORTED;
  return merge_large(e, p, (uint32_t)len, out);
}

/* -- whole texts ---------------------------------------------------------------------------- */

/* Append s[i:j] to `pieces` as a str (the `split` method's output). */
static int add_piece(PyObject *pieces, const uint8_t *s, Py_ssize_t i, Py_ssize_t j) {
  PyObject *piece = PyUnicode_DecodeUTF8((const char *)s + i, j - i, "strict");
  if (piece == NULL) return FAILED;
  int rc = PyList_Append(pieces, piece);
  Py_DECREF(piece);
  return rc < 0 ? FAILED : OK;
}

/* Encode s[i:n], text between added tokens; with `pieces`, list the pre-tokenizer's pieces instead. */
static int encode_span(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n, IdBuf *out, PyObject *pieces) {
  while (i < n) {
    Py_ssize_t j = e->scan == SCAN_LLAMA3 ? piece_llama3(e, s, i, n) : piece_gpt2(e, s, i, n);
    if (j < 0) return UNSUPPORTED;
    int rc = pieces ? add_piece(pieces, s, i, j) : emit_piece(e, s + i, j - i, out);
    if (rc != OK) return rc;
    i = j;
  }
  return OK;
}

/* Length of the longest added token at s[i] (its id in *id), or 0. */
static inline Py_ssize_t added_at(const Encoder *e, const uint8_t *s, Py_ssize_t i, Py_ssize_t n, uint32_t *id) {
  uint8_t b = s[i];
  if (e->added_lo[b] == e->added_hi[b]) return 0;
  if (i + 1 < n && !e->added_len1[b]) {
    unsigned pair = (unsigned)b << 8 | s[i + 1];
    if (!(e->added_pair[pair >> 3] & (1u << (pair & 7)))) return 0;
  }
  for (uint32_t k = e->added_lo[b]; k < e->added_hi[b]; k++) {
    const Added *a = &e->added[k];
    if (a->len <= (size_t)(n - i) && memcmp(e->added_text + a->off, s + i, a->len) == 0) {
      *id = a->id;
      return a->len;
    }
  }
  return 0;
}

static int encode_text(const Encoder *e, const uint8_t *s, Py_ssize_t n, IdBuf *out, PyObject *pieces) {
  if (e->any_bad)
    for (Py_ssize_t i = 0; i < n; i++)
      if (e->bad_byte[s[i]]) return UNSUPPORTED;
  Py_ssize_t start = 0;
  if (e->n_added)
    for (Py_ssize_t i = 0; i < n; i++) {
      uint32_t id;
      Py_ssize_t len = added_at(e, s, i, n, &id);
      if (len == 0) continue;
      int rc = encode_span(e, s, start, i, out, pieces);
      if (rc == OK) rc = pieces ? add_piece(pieces, s, i, i + len) : buf_push(out, id);
      if (rc != OK) return rc;
      start = i + len;
      i = start - 1;
    }
  return encode_span(e, s, start, n, out, pieces);
}

/* A new list of ids, None (a new reference) when the fallback must answer, or NULL on error. */
static PyObject *encode_one(const Encoder *e, PyObject *text) {
  if (!PyUnicode_Check(text)) {
    PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(text)->tp_name);
    return NULL;
  }
  Py_ssize_t n;
  const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
  if (utf8 == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return NULL;
    PyErr_Clear(); /* lone surrogates */
    Py_RETURN_NONE;
  }
  IdBuf out;
  buf_init(&out);
  PyObject *result = NULL;
  int rc;
  if (n >= RELEASE_GIL_BYTES) {
    PyThreadState *thread = PyEval_SaveThread();
    rc = encode_text(e, (const uint8_t *)utf8, n, &out, NULL);
    PyEval_RestoreThread(thread);
  } else {
    rc = encode_text(e, (const uint8_t *)utf8, n, &out, NULL);
  }
  for (size_t i = 0; rc == OK && i < out.n; i++)
    if (out.v[i] >= (uint32_t)e->n_ids) rc = UNSUPPORTED;
  if (rc == FAILED) {
    PyErr_NoMemory();
  } else if (rc == UNSUPPORTED) {
    result = Py_NewRef(Py_None);
  } else if ((result = PyList_New((Py_ssize_t)out.n)) != NULL) {
    for (size_t i = 0; i < out.n; i++) PyList_SET_ITEM(result, (Py_ssize_t)i, Py_NewRef(e->ids[out.v[i]]));
  }
  buf_free(&out);
  return result;
}

static int check_ready(const Encoder *e) {
  if (e->ready) return 1;
  PyErr_SetString(PyExc_RuntimeError, "Encoder is not initialised");
  return 0;
}

static PyObject *Encoder_encode(PyObject *self, PyObject *text) {
  if (!check_ready((const Encoder *)self)) return NULL;
  return encode_one((const Encoder *)self, text);
}

static PyObject *Encoder_split(PyObject *self, PyObject *text) {
  const Encoder *e = (const Encoder *)self;
  if (!check_ready(e)) return NULL;
  if (!PyUnicode_Check(text)) {
    PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(text)->tp_name);
    return NULL;
  }
  Py_ssize_t n;
  const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
  if (utf8 == NULL) return NULL;
  PyObject *pieces = PyList_New(0);
  if (pieces == NULL) return NULL;
  int rc = encode_text(e, (const uint8_t *)utf8, n, NULL, pieces);
  if (rc == OK) return pieces;
  Py_DECREF(pieces);
  if (rc == UNSUPPORTED) Py_RETURN_NONE;
  return NULL;
}

static PyObject *Encoder_encode_batch(PyObject *self, PyObject *texts) {
  if (!check_ready((const Encoder *)self)) return NULL;
  PyObject *seq = PySequence_Fast(texts, "encode_batch expects a sequence of str");
  if (seq == NULL) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject *result = PyList_New(n);
  for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
    PyObject *text = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i)); /* kept alive without the GIL */
    PyObject *ids = encode_one((const Encoder *)self, text);
    Py_DECREF(text);
    if (ids == NULL) {
      Py_CLEAR(result);
    } else {
      PyList_SET_ITEM(result, i, ids);
    }
  }
  Py_DECREF(seq);
  return result;
}

/* -- construction --------------------------------------------------------------------------- */

static int load_vocab(Encoder *e, PyObject *ranks, PyObject *rank_to_id) {
  Py_ssize_t n = PyDict_GET_SIZE(ranks), pos = 0, total = 0;
  PyObject *key, *value;
  while (PyDict_Next(ranks, &pos, &key, &value)) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) == 0) {
      PyErr_SetString(PyExc_TypeError, "ranks must map non-empty bytes to int");
      return -1;
    }
    total += PyBytes_GET_SIZE(key);
  }
  if (total >= (Py_ssize_t)UINT32_MAX || n >= (Py_ssize_t)(UINT32_MAX / 4)) {
    PyErr_SetString(PyExc_ValueError, "vocabulary too large");
    return -1;
  }
  uint64_t size = 16;
  while (size < 2 * (uint64_t)n) size *= 2;
  e->arena = PyMem_Malloc(total ? (size_t)total : 1);
  e->entries = PyMem_Malloc((n ? (size_t)n : 1) * sizeof *e->entries);
  e->slots = PyMem_Calloc((size_t)size, sizeof *e->slots);
  if (!e->arena || !e->entries || !e->slots) {
    PyErr_NoMemory();
    return -1;
  }
  e->mask = size - 1;
  for (int b = 0; b < 256; b++) e->byte_id[b] = NO_ID;
  Py_ssize_t n_map = rank_to_id == Py_None ? 0 : PyList_GET_SIZE(rank_to_id);
  uint32_t off = 0, count = 0;
  pos = 0;
  while (PyDict_Next(ranks, &pos, &key, &value)) {
    unsigned long long rank = PyLong_AsUnsignedLongLong(value);
    if (PyErr_Occurred()) return -1;
    if (rank >= NO_RANK) {
      PyErr_SetString(PyExc_ValueError, "rank out of range");
      return -1;
    }
    uint32_t id = (uint32_t)rank;
    if (rank_to_id != Py_None) {
      id = NO_ID; /* a byte the vocabulary lacks: never emitted, such texts are rejected first */
      if ((Py_ssize_t)rank < n_map) {
        unsigned long long mapped = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(rank_to_id, (Py_ssize_t)rank));
        if (PyErr_Occurred()) return -1;
        id = mapped < NO_ID ? (uint32_t)mapped : NO_ID;
      }
    }
    uint32_t len = (uint32_t)PyBytes_GET_SIZE(key);
    const uint8_t *raw = (const uint8_t *)PyBytes_AS_STRING(key);
    memcpy(e->arena + off, raw, len);
    e->entries[count] = (Entry){off, len, (uint32_t)rank, id};
    uint64_t h = hash_bytes(raw, len);
    uint64_t i = h & e->mask;
    while (e->slots[i].entry) i = (i + 1) & e->mask;
    e->slots[i] = (Slot){(uint32_t)(h >> 32), count + 1};
    if (len == 1) e->byte_id[raw[0]] = id;
    off += len;
    count++;
  }
  for (int b = 0; b < 256; b++) {
    uint8_t byte = (uint8_t)b;
    if (find(e, &byte, 1) == NULL) {
      PyErr_Format(PyExc_ValueError, "byte 0x%02x has no rank", b);
      return -1;
    }
  }
  return 0;
}

/* By first byte, then longest first. */
static int cmp_added(const void *pa, const void *pb) {
  const Added *a = pa, *b = pb;
  if (a->first != b->first) return a->first < b->first ? -1 : 1;
  if (a->len != b->len) return a->len > b->len ? -1 : 1;
  return 0;
}

static int load_added(Encoder *e, PyObject *added) {
  Py_ssize_t n = PyDict_GET_SIZE(added), pos = 0, total = 0, len;
  PyObject *key, *value;
  while (PyDict_Next(added, &pos, &key, &value)) {
    if (!PyUnicode_Check(key) || PyUnicode_AsUTF8AndSize(key, &len) == NULL) return -1;
    if (len == 0) {
      PyErr_SetString(PyExc_ValueError, "empty added token");
      return -1;
    }
    total += len;
  }
  e->added_text = PyMem_Malloc(total ? (size_t)total : 1);
  e->added = PyMem_Malloc((n ? (size_t)n : 1) * sizeof *e->added);
  if (!e->added_text || !e->added) {
    PyErr_NoMemory();
    return -1;
  }
  uint32_t off = 0;
  Py_ssize_t count = 0;
  pos = 0;
  while (PyDict_Next(added, &pos, &key, &value)) {
    const char *text = PyUnicode_AsUTF8AndSize(key, &len);
    unsigned long long id = PyLong_AsUnsignedLongLong(value);
    if (PyErr_Occurred()) return -1;
    if (id >= NO_ID) {
      PyErr_SetString(PyExc_ValueError, "added token id out of range");
      return -1;
    }
    memcpy(e->added_text + off, text, (size_t)len);
    e->added[count++] = (Added){off, (uint32_t)len, (uint32_t)id, (uint8_t)text[0]};
    off += (uint32_t)len;
  }
  e->n_added = count;
  qsort(e->added, (size_t)count, sizeof *e->added, cmp_added);
  for (Py_ssize_t k = 0; k < count; k++) {
    const uint8_t *t = e->added_text + e->added[k].off;
    if (e->added_lo[t[0]] == e->added_hi[t[0]]) e->added_lo[t[0]] = (uint32_t)k;
    e->added_hi[t[0]] = (uint32_t)k + 1;
    if (e->added[k].len == 1) {
      e->added_len1[t[0]] = 1;
    } else {
      unsigned pair = (unsigned)t[0] << 8 | t[1];
      e->added_pair[pair >> 3] |= (uint8_t)(1u << (pair & 7));
    }
  }
  return 0;
}

static int Encoder_init(PyObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"scan",       "digits", "fold_case", "letter",     "classes", "ranks",
                           "rank_to_id", "added",  "bad_bytes", "vocab_size", NULL};
  Encoder *e = (Encoder *)self;
  int scan, digits, fold_case, letter;
  PyObject *classes, *ranks, *rank_to_id, *added;
  Py_buffer bad;
  Py_ssize_t vocab_size;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "iipiO!O!OO!y*n", kwlist, &scan, &digits, &fold_case, &letter,
                                   &PyBytes_Type, &classes, &PyDict_Type, &ranks, &rank_to_id, &PyDict_Type, &added,
                                   &bad, &vocab_size))
    return -1;
  int rc = -1;
  if (e->ready || e->classes != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Encoder is already initialised");
    goto out;
  }
  if ((scan != SCAN_GPT2 && scan != SCAN_LLAMA3) || digits < 0 || (scan == SCAN_LLAMA3 && digits < 1) || letter <= 0 ||
      letter > 0xFF || PyBytes_GET_SIZE(classes) != N_CODE_POINTS || bad.len != 256 || vocab_size < 0 ||
      vocab_size >= (Py_ssize_t)NO_ID) {
    PyErr_SetString(PyExc_ValueError, "bad Encoder arguments");
    goto out;
  }
  if (rank_to_id != Py_None && !PyList_Check(rank_to_id)) {
    PyErr_SetString(PyExc_TypeError, "rank_to_id must be a list or None");
    goto out;
  }
  e->scan = scan;
  e->digits = digits;
  e->fold_case = fold_case;
  e->letter = (uint8_t)letter;
  e->punct_stop = (uint8_t)(CL_WS | CL_L | CL_N | CL_UNKNOWN | letter);
  e->classes = Py_NewRef(classes);
  e->cls = (const uint8_t *)PyBytes_AS_STRING(classes);
  for (int b = 0; b < 256; b++) {
    e->bad_byte[b] = ((const uint8_t *)bad.buf)[b] != 0;
    e->any_bad |= e->bad_byte[b];
  }
  if (load_vocab(e, ranks, rank_to_id) < 0 || load_added(e, added) < 0) goto out;
  e->ids = PyMem_Calloc(vocab_size ? (size_t)vocab_size : 1, sizeof *e->ids);
  if (e->ids == NULL) {
    PyErr_NoMemory();
    goto out;
  }
  for (Py_ssize_t i = 0; i < vocab_size; i++) {
    e->ids[i] = PyLong_FromSsize_t(i);
    if (e->ids[i] == NULL) goto out;
    e->n_ids = i + 1;
  }
  e->ready = 1;
  rc = 0;
out:
  PyBuffer_Release(&bad);
  return rc;
}

static void Encoder_dealloc(PyObject *self) {
  Encoder *e = (Encoder *)self;
  for (Py_ssize_t i = 0; i < e->n_ids; i++) Py_DECREF(e->ids[i]);
  PyMem_Free(e->ids);
  PyMem_Free(e->arena);
  PyMem_Free(e->entries);
  PyMem_Free(e->slots);
  PyMem_Free(e->added_text);
  PyMem_Free(e->added);
  Py_XDECREF(e->classes);
  Py_TYPE(self)->tp_free(self);
}

static PyObject *Encoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  return type->tp_alloc(type, 0); /* zero-filled */
}

static PyMethodDef Encoder_methods[] = {
    {"encode", Encoder_encode, METH_O, "encode(text) -> list of ids, or None when the fallback must encode it"},
    {"encode_batch", Encoder_encode_batch, METH_O, "encode_batch(texts) -> [encode(text) for text in texts]"},
    {"split", Encoder_split, METH_O, "split(text) -> the added tokens and pre-tokenizer pieces, or None"},
    {NULL, NULL, 0, NULL},
};

// clang-format off
static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dpu_tokenizer._fastbpe.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Byte-level BPE with a hand-written pre-tokenizer for the gpt2 and llama3 pattern families.",
    .tp_new = Encoder_new,
    .tp_init = Encoder_init,
    .tp_dealloc = Encoder_dealloc,
    .tp_methods = Encoder_methods,
};
// clang-format on

static struct PyModuleDef fastbpe_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fastbpe",
    .m_doc = "Byte-level BPE encoder without a regex engine.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__fastbpe(void) {
  if (PyType_Ready(&EncoderType) < 0) return NULL;
  PyObject *mod = PyModule_Create(&fastbpe_module);
  if (mod == NULL) return NULL;
  if (PyModule_AddObjectRef(mod, "Encoder", (PyObject *)&EncoderType) < 0 ||
      PyModule_AddIntConstant(mod, "SCAN_GPT2", SCAN_GPT2) < 0 ||
      PyModule_AddIntConstant(mod, "SCAN_LLAMA3", SCAN_LLAMA3) < 0 || PyModule_AddIntConstant(mod, "CL_L", CL_L) < 0 ||
      PyModule_AddIntConstant(mod, "CL_N", CL_N) < 0 || PyModule_AddIntConstant(mod, "CL_M", CL_M) < 0 ||
      PyModule_AddIntConstant(mod, "CL_WS", CL_WS) < 0 || PyModule_AddIntConstant(mod, "CL_UNKNOWN", CL_UNKNOWN) < 0) {
    Py_DECREF(mod);
    return NULL;
  }
  return mod;
}
