/* The token chain of TokenMap.chain (tokens.py), in C, and with it a busy engine's outputs redacted
 * (Redactor._plain_outputs, frames.py).
 *
 * Prefix: a running keyed BLAKE2b, as hashlib.blake2b (copy, update, digest) but with its state in plain
 * memory (blake2b.h), which the chain finalizes per token on the stack: no call, no bytes object.
 *
 * chain: each token mapped in its context, the running hash of the tokens before it: its digest gives
 * the shift, then the token's 4 bytes extend it. TokenMap holds the construction; this only runs it, a
 * prompt of thousands of tokens at each ADD.
 *
 * outputs: at 2,000 steps a second of 32 outputs, decoding each step's outputs into Python objects,
 * walking them and encoding them again was most of the redactor's work. This reads the outputs' msgpack
 * and writes it redacted as the walk would, byte for byte (tests/redact/test_fast_paths.py): each
 * output's request id hashed (from the hasher's cache, else by calling it), its tokens chained in their
 * request's context, its stop reason hashed if it is text. It reads and checks every output first; if
 * any is not one it takes, it returns None before touching a context, and the caller walks.
 *
 * unchanged: whether the walk would give a struct's msgpack back as it is (Redactor._unchanged, on bytes),
 * so that a busy step is not decoded at all: its other fields checked, its outputs found for the above.
 * An ADD is checked the same way before its fast path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "blake2b.h"
#include "msgpack.h"

static PyObject *prefix_name, *fixed_name;

typedef struct {
    PyObject_HEAD
    blake2b_state state;
} Prefix;

static PyTypeObject PrefixType;

static PyObject *prefix_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "key", "person", "digest_size", NULL};
    Py_buffer data = {NULL}, key = {NULL}, person = {NULL};
    Py_ssize_t digest_size = BLAKE2B_OUT_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|y*$y*y*n", names, &data, &key, &person, &digest_size))
        return NULL;
    Prefix *self = NULL;
    if (digest_size < 1 || digest_size > BLAKE2B_OUT_MAX || key.len > BLAKE2B_KEY_MAX || person.len > BLAKE2B_PERSON)
        PyErr_SetString(PyExc_ValueError, "Prefix(data, *, key of 0-64 bytes, person of 0-16, digest_size 1-64)");
    else if ((self = (Prefix *)type->tp_alloc(type, 0)) != NULL) {
        blake2b_init(&self->state, (size_t)digest_size, key.buf, (size_t)key.len, person.buf, (size_t)person.len);
        blake2b_update(&self->state, data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    PyBuffer_Release(&person);
    return (PyObject *)self;
}

static PyObject *prefix_copy(Prefix *self, PyObject *unused) {
    Prefix *copy = (Prefix *)PrefixType.tp_alloc(&PrefixType, 0);
    if (copy != NULL)
        copy->state = self->state;
    return (PyObject *)copy;
}

static PyObject *prefix_update(Prefix *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    blake2b_update(&self->state, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *prefix_digest(Prefix *self, PyObject *unused) {
    uint8_t out[BLAKE2B_OUT_MAX];
    blake2b_digest(&self->state, out);
    return PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)self->state.outlen);
}

static PyMethodDef prefix_methods[] = {
    {"copy", (PyCFunction)prefix_copy, METH_NOARGS, "A copy, which goes on by itself."},
    {"update", (PyCFunction)prefix_update, METH_O, "Hash these bytes after what came before."},
    {"digest", (PyCFunction)prefix_digest, METH_NOARGS, "The digest of what was hashed so far."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PrefixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "replay_proxy.redact._chain.Prefix",
    .tp_doc = "A running keyed BLAKE2b: Prefix(data=b'', *, key, person, digest_size), as hashlib.blake2b.",
    .tp_basicsize = sizeof(Prefix),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = prefix_new,
    .tp_methods = prefix_methods,
};

/* The first 8 bytes of the digest of what ``state`` hashed, little-endian (int.from_bytes(digest[:8],
 * "little")), and the digest as bytes into ``*digest`` unless it is NULL; -1 only if that fails. */
static int shift_of(const blake2b_state *state, uint64_t *shift, PyObject **digest) {
    uint8_t out[BLAKE2B_OUT_MAX];
    blake2b_digest(state, out);
    *shift = blake2b_load64(out);
    if (digest != NULL && (*digest = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)state->outlen)) == NULL)
        return -1;
    return 0;
}

/* pi(t) = P[(t + shift) % V], walked along its cycle past the fixed points (TokenMap._map). */
static PyObject *mapped(PyObject *original, long token, uint64_t shift, PyObject *fixed, PyObject *permutation,
                        long size) {
    int is_fixed = PySet_GET_SIZE(fixed) ? PySet_Contains(fixed, original) : 0;
    if (is_fixed < 0)
        return NULL;
    if (is_fixed) {
        Py_INCREF(original);
        return original;
    }
    uint64_t step = shift % (uint64_t)size;  /* (t + shift) % V, without overflowing 64 bits */
    PyObject *out = PyList_GET_ITEM(permutation, (Py_ssize_t)(((uint64_t)token + step) % (uint64_t)size));
    while (PySet_GET_SIZE(fixed) && (is_fixed = PySet_Contains(fixed, out)) != 0) {
        if (is_fixed < 0)
            return NULL;
        out = PyList_GET_ITEM(permutation, (Py_ssize_t)(((uint64_t)PyLong_AsLong(out) + step) % (uint64_t)size));
    }
    Py_INCREF(out);
    return out;
}

/* One step of the chain: the shift of the next token, drawn from the state before it (into ``*digest``
 * as bytes too, unless it is NULL), then the token's 4 bytes, little-endian, extend the state. 0, or -1
 * with an exception set if the bytes could not be made. */
static int chain_step(blake2b_state *state, long token, uint64_t *shift, PyObject **digest) {
    if (shift_of(state, shift, digest) < 0)
        return -1;
    const uint8_t bytes[4] = {(uint8_t)token, (uint8_t)(token >> 8), (uint8_t)(token >> 16), (uint8_t)(token >> 24)};
    blake2b_update(state, bytes, 4);
    return 0;
}

/* The tokens of the list ``tokens`` (ints in the vocabulary: checked by the caller) chained after
 * ``prefix``, which they extend, into the new list ``out`` of the same length; the state before each
 * appended to ``states`` unless it is NULL. 0, or -1 with an exception set. */
static int chain_into(Prefix *prefix, PyObject *tokens, PyObject *out, PyObject *fixed, PyObject *permutation,
                      PyObject *states) {
    long size = (long)PyList_GET_SIZE(permutation);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tokens); j++) {
        PyObject *original = PyList_GET_ITEM(tokens, j), *state = NULL;
        long token = PyLong_AsLong(original);
        uint64_t shift;
        if (chain_step(&prefix->state, token, &shift, states == NULL ? NULL : &state) < 0)
            return -1;
        if (state != NULL) {
            int appended = PyList_Append(states, state);
            Py_DECREF(state);
            if (appended < 0)
                return -1;
        }
        PyObject *pseudonym = mapped(original, token, shift, fixed, permutation, size);
        if (pseudonym == NULL)
            return -1;
        PyList_SET_ITEM(out, j, pseudonym);
    }
    return 0;
}

/* chain(prefix, tokens, fixed, permutation, states) -> the tokens redacted (TokenMap.chain, which checks
 * that they are in the vocabulary); TypeError if one is not an int. */
static PyObject *chain(PyObject *module, PyObject *args) {
    PyObject *prefix, *tokens, *fixed, *permutation, *states;
    if (!PyArg_ParseTuple(args, "O!O!OO!O", &PrefixType, &prefix, &PyList_Type, &tokens, &fixed, &PyList_Type,
                          &permutation, &states))
        return NULL;
    long size = (long)PyList_GET_SIZE(permutation);
    if (!PyAnySet_Check(fixed) || !(states == Py_None || PyList_Check(states))) {
        PyErr_SetString(PyExc_TypeError, "chain(prefix, tokens, fixed set, permutation, states list)");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tokens); j++) {  /* all checked before the context moves */
        PyObject *token = PyList_GET_ITEM(tokens, j);
        long t = PyLong_Check(token) ? PyLong_AsLong(token) : -1;
        if (t < 0 || t >= size) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "a token is not an int in the vocabulary");
            return NULL;
        }
    }
    PyObject *out = PyList_New(PyList_GET_SIZE(tokens));
    if (out == NULL)
        return NULL;
    if (chain_into((Prefix *)prefix, tokens, out, fixed, permutation, states == Py_None ? NULL : states) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *hashed(PyObject *text, PyObject *known, PyObject *hasher) {
    PyObject *cached = PyDict_GetItemWithError(known, text);
    if (cached != NULL) {
        Py_INCREF(cached);
        return cached;
    }
    return PyErr_Occurred() ? NULL : PyObject_CallOneArg(hasher, text);
}

/* --- what the walk gives back as it is ------------------------------------------------------------- */

/* Redactor._unchanged (frames.py) on msgpack, so that a busy step is never decoded: whether the walk gives
 * a struct back as it is. Shape holds frames.Kept's tables for a struct and those nested in it, compiled:
 * for each field, the kinds of value given back as they are (as_is), and the kinds (types) of one that is
 * a struct itself (nested), or a list or map of them that is given back only when empty (container). Kinds
 * are bits (_KINDS in frames.py); nil is always given back, an ext never here (the walk takes it). */
enum { BOOL = 1, INT = 2, FLOAT = 4, TEXT = 8, BIN = 16, ARRAY = 32, MAP = 64 };

typedef struct {
    char *name;  /* a map's field: its name, UTF-8 (an array's: by position) */
    Py_ssize_t name_length, nested;  /* nested: the struct's index, or -1 */
    long as_is, types;
    int container;
} shape_field;

typedef struct {
    int encoding;  /* ARRAY, MAP, or 0: no struct the walk gives back as it is */
    Py_ssize_t count;
    shape_field *fields;
} shape_struct;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    shape_struct *structs;  /* the first is the one asked about */
} Shape;

static long kind_of(const reader *r) {
    PyTypeObject *type = type_of(r);
    return type == &PyBool_Type ? BOOL : type == &PyLong_Type ? INT : type == &PyFloat_Type ? FLOAT
           : type == &PyUnicode_Type ? TEXT : type == &PyBytes_Type ? BIN : type == &PyList_Type ? ARRAY
           : type == &PyDict_Type ? MAP : 0;
}

static void shape_dealloc(Shape *self) {
    for (Py_ssize_t i = 0; i < self->count; i++) {
        for (Py_ssize_t j = 0; j < self->structs[i].count; j++)
            PyMem_Free(self->structs[i].fields[j].name);
        PyMem_Free(self->structs[i].fields);
    }
    PyMem_Free(self->structs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Shape([(encoding, [(name or position, as_is, types, nested, container), ...]), ...]): see above. An
 * array struct's fields are given by position, each once; a position not given takes only nil. */
static PyObject *shape_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *structs;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &structs))
        return NULL;
    Shape *self = (Shape *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(structs);
    if ((self->structs = PyMem_Calloc(count ? (size_t)count : 1, sizeof *self->structs)) == NULL)
        goto no_memory;
    self->count = count;
    for (Py_ssize_t i = 0; i < count; i++) {
        shape_struct *st = &self->structs[i];
        PyObject *fields;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(structs, i), "iO!", &st->encoding, &PyList_Type, &fields))
            goto fail;
        Py_ssize_t n = PyList_GET_SIZE(fields), slots = n;
        if (st->encoding == ARRAY)  /* by position: as many slots as the last position given */
            for (Py_ssize_t j = 0; j < n; j++) {
                Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GetItem(PyList_GET_ITEM(fields, j), 0));
                if (at < 0 || at > 4096) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_ValueError, "an array struct's field is a position");
                    goto fail;
                }
                slots = at + 1 > slots ? at + 1 : slots;
            }
        if ((st->fields = PyMem_Calloc(slots ? (size_t)slots : 1, sizeof *st->fields)) == NULL)
            goto no_memory;
        st->count = slots;
        for (Py_ssize_t j = 0; j < slots; j++)
            st->fields[j].nested = -1;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *key;
            shape_field field = {NULL, 0, -1, 0, 0, 0};
            if (!PyArg_ParseTuple(PyList_GET_ITEM(fields, j), "Ollnp", &key, &field.as_is, &field.types, &field.nested,
                                  &field.container))
                goto fail;
            if (field.nested < -1 || field.nested >= count) {
                PyErr_SetString(PyExc_ValueError, "a nested struct's index is out of range");
                goto fail;
            }
            shape_field *slot = &st->fields[j];
            if (st->encoding == ARRAY)
                slot = &st->fields[PyLong_AsSsize_t(key)];
            else {
                const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &field.name_length) : NULL;
                if (name == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_TypeError, "a map struct's field is its name");
                    goto fail;
                }
                if ((field.name = PyMem_Malloc((size_t)field.name_length + 1)) == NULL)
                    goto no_memory;
                memcpy(field.name, name, (size_t)field.name_length + 1);
            }
            *slot = field;
        }
    }
    return (PyObject *)self;
no_memory:
    PyErr_NoMemory();
fail:
    Py_DECREF(self);
    return NULL;
}

static PyTypeObject ShapeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "replay_proxy.redact._chain.Shape",
    .tp_doc = "frames.Kept's tables for a struct and those nested in it, compiled (see the module's comment).",
    .tp_basicsize = sizeof(Shape),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = shape_new,
    .tp_dealloc = (destructor)shape_dealloc,
};

/* Past a map struct's key: -1 if it is not text; else ``*field`` is the field it names (NULL: none the walk
 * gives back). Fields come in their struct's order, so the one after the last found is tried first. */
static int named(reader *r, const shape_struct *st, Py_ssize_t *next, const shape_field **field) {
    uint8_t b = r->p < r->end ? *r->p : 0xc1;
    int n = (b & 0xe0) == 0xa0 ? 0 : (b == 0xd9 || b == 0xda || b == 0xdb) ? length_bytes(b) : -1;
    if (n < 0 || r->end - r->p < 1 + n)
        return -1;
    uint64_t length = n ? big_endian(r->p + 1, n) : (uint64_t)(b & 0x1f);
    const uint8_t *name = r->p + 1 + n;
    if ((uint64_t)(r->end - name) < length)
        return -1;
    r->p = name + length;
    *field = NULL;
    for (Py_ssize_t k = 0; k < st->count; k++) {
        const shape_field *candidate = &st->fields[(*next + k) % st->count];
        if ((uint64_t)candidate->name_length == length && memcmp(candidate->name, name, length) == 0) {
            *next = (*next + k + 1) % st->count;
            *field = candidate;
            break;
        }
    }
    return 0;
}

static int struct_unchanged(reader *r, const Shape *shape, Py_ssize_t index, Py_ssize_t but, const uint8_t **span,
                            int depth);

/* The value at ``r``, of ``field`` (NULL: no field the walk gives back), given back as it is; past it if so. */
static int field_unchanged(reader *r, const Shape *shape, const shape_field *field, int depth) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    long kind = kind_of(r);
    uint64_t items;
    if (field == NULL || kind == 0)
        return 0;
    if (kind & field->as_is)
        return skip_kept(r, depth) == 0;
    if (!(kind & field->types))
        return 0;
    if (field->container)  /* a list or map of structs (or hashed), walked unless it is empty */
        return (kind == ARRAY ? read_array(r, &items) == 0 : kind == MAP ? read_map(r, &items) == 0 : 0) && items == 0;
    return field->nested >= 0 && struct_unchanged(r, shape, field->nested, -1, NULL, depth + 1);
}

/* ``shape``'s struct ``index`` at ``r``, given back as it is but for its element ``but`` (of an array
 * struct; -1: none), which must only be whole msgpack and whose start and end go into ``span``. */
static int struct_unchanged(reader *r, const Shape *shape, Py_ssize_t index, Py_ssize_t but, const uint8_t **span,
                            int depth) {
    const shape_struct *st = &shape->structs[index];
    uint64_t items;
    if (depth > 64 || st->encoding == 0 || kind_of(r) != st->encoding
            || (st->encoding == MAP ? read_map(r, &items) : read_array(r, &items)) < 0)
        return 0;
    Py_ssize_t next = 0;
    for (uint64_t i = 0; i < items; i++) {
        if (st->encoding == MAP) {
            const shape_field *field;
            if (named(r, st, &next, &field) < 0 || !field_unchanged(r, shape, field, depth))
                return 0;
        } else if ((Py_ssize_t)i == but) {
            span[0] = r->p;
            if (skip(r, depth) < 0)
                return 0;
            span[1] = r->p;
        } else if (!field_unchanged(r, shape, i < (uint64_t)st->count ? &st->fields[i] : NULL, depth))
            return 0;
    }
    return 1;
}

/* unchanged(data, shape, but=-1) -> whether ``data`` is all one struct (shape's first) that the walk gives
 * back as it is, but for its element ``but``: then (start, end) of that element (None if there is none),
 * else False. */
static PyObject *unchanged(PyObject *module, PyObject *args) {
    Py_buffer data;
    PyObject *shape;
    Py_ssize_t but = -1;
    if (!PyArg_ParseTuple(args, "y*O!|n", &data, &ShapeType, &shape, &but))
        return NULL;
    reader r = {data.buf, (const uint8_t *)data.buf + data.len};
    const uint8_t *span[2] = {NULL, NULL};
    PyObject *result;
    if (((Shape *)shape)->count == 0 || !struct_unchanged(&r, (Shape *)shape, 0, but, span, 0) || r.p != r.end)
        result = Py_NewRef(Py_False);
    else if (span[0] == NULL)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("nn", (Py_ssize_t)(span[0] - (const uint8_t *)data.buf),
                               (Py_ssize_t)(span[1] - (const uint8_t *)data.buf));
    PyBuffer_Release(&data);
    return result;
}

/* --- the outputs of a step ------------------------------------------------------------------------ */

enum role { NIL, REQUEST_ID, TOKENS, FINISH_REASON, STOP_REASON, NANS };

/* One output the fast path takes, as the first pass read it. */
typedef struct {
    PyObject *rid, *prefix, *fixed, *stop;  /* stop: text, else NULL */
    const uint8_t *tokens, *tokens_end;  /* its token ids' msgpack */
    uint64_t token_count;
    int64_t finish, stop_int, nans;
    int has_finish, has_stop_int;
} plain_output;

static void release_outputs(plain_output *outputs, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        Py_XDECREF(outputs[i].rid);
        Py_XDECREF(outputs[i].prefix);
        Py_XDECREF(outputs[i].fixed);
        Py_XDECREF(outputs[i].stop);
    }
    PyMem_Free(outputs);
}

/* Reads one output into ``o``: 1 if the fast path takes it, 0 if not, -1 with an exception set. An output
 * it takes is an array of the release's length, nil where the fast path has no column, with a text id of
 * a request known, a list of ids in the vocabulary, an int NaN count, a finish reason nil or int, a stop
 * reason nil, int or text. */
static int read_output(reader *r, plain_output *o, const uint8_t *roles, uint64_t length, PyObject *live,
                       PyObject *ended, long size) {
    uint64_t items;
    if (read_array(r, &items) < 0 || items != length)
        return 0;
    for (uint64_t k = 0; k < length; k++) {
        int nil = r->p < r->end && *r->p == 0xc0;
        switch (roles[k]) {
        case NIL:
            if (!nil)
                return 0;
            r->p++;
            break;
        case REQUEST_ID:
            if ((o->rid = read_str(r)) == NULL)
                return 0;
            break;
        case TOKENS:
            if (read_array(r, &o->token_count) < 0)
                return 0;
            o->tokens = r->p;
            for (uint64_t j = 0; j < o->token_count; j++) {
                int64_t token;
                if (read_int(r, &token) < 0 || token < 0 || token >= size)
                    return 0;
            }
            o->tokens_end = r->p;
            break;
        case FINISH_REASON:
            o->has_finish = !nil;
            if (nil ? (r->p++, 0) : read_int(r, &o->finish) < 0)
                return 0;
            break;
        case STOP_REASON:
            if (nil)
                r->p++;
            else if (read_int(r, &o->stop_int) == 0)
                o->has_stop_int = 1;
            else if ((o->stop = read_str(r)) == NULL)
                return 0;
            break;
        case NANS:
            if (read_int(r, &o->nans) < 0)
                return 0;
            break;
        }
    }
    PyObject *context = PyDict_GetItemWithError(live, o->rid);
    if (context == NULL && !PyErr_Occurred())
        context = PyDict_GetItemWithError(ended, o->rid);
    if (context == NULL)
        return PyErr_Occurred() ? -1 : 0;
    o->prefix = PyObject_GetAttr(context, prefix_name);
    o->fixed = PyObject_GetAttr(context, fixed_name);
    if (o->prefix == NULL || o->fixed == NULL)
        return -1;
    if (!PyAnySet_Check(o->fixed) || !PyObject_TypeCheck(o->prefix, &PrefixType)) {
        PyErr_SetString(PyExc_TypeError, "a context's prefix is not a Prefix, or its fixed tokens not a set");
        return -1;
    }
    return 1;
}

static int put_tokens(writer *w, plain_output *o, PyObject *fixed, PyObject *permutation) {
    long size = (long)PyList_GET_SIZE(permutation);
    reader r = {o->tokens, o->tokens_end};  /* (read and checked by the first pass) */
    if (put_array(w, o->token_count) < 0)
        return -1;
    for (uint64_t j = 0; j < o->token_count; j++) {
        int64_t token;
        uint64_t shift;
        read_int(&r, &token);
        chain_step(&((Prefix *)o->prefix)->state, (long)token, &shift, NULL);
        PyObject *original = PyLong_FromLongLong(token), *pseudonym = NULL;
        if (original != NULL)
            pseudonym = mapped(original, (long)token, shift, fixed, permutation, size);
        long out = pseudonym == NULL ? -1 : PyLong_AsLong(pseudonym);
        Py_XDECREF(original);
        Py_XDECREF(pseudonym);
        if (out < 0 || put_int(w, out) < 0)
            return -1;
    }
    return 0;
}

/* outputs(data, length, columns, live, ended, hasher, known, permutation)
 *   -> (the outputs redacted, as msgpack, and the ids of the requests that finished), from ``data``, the
 *   msgpack of a step's outputs; or None if it is not that, or any output is not one the fast path takes
 *   (before anything is redacted: each is read and checked first). */
static PyObject *redact_outputs(PyObject *module, PyObject *args) {
    Py_buffer data;
    PyObject *live, *ended, *hasher, *known, *permutation;
    Py_ssize_t length, at[5];  /* request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits */
    if (!PyArg_ParseTuple(args, "y*n(nnnnn)O!O!OO!O!", &data, &length, &at[0], &at[1],
                          &at[2], &at[3], &at[4], &PyDict_Type, &live, &PyDict_Type, &ended, &hasher, &PyDict_Type,
                          &known, &PyList_Type, &permutation))
        return NULL;
    PyObject *result = NULL, *finished = NULL;
    plain_output *outputs = NULL;
    uint8_t *roles = PyMem_Calloc(length > 0 ? (size_t)length : 1, 1);
    writer w = {NULL, 0, 0};
    reader r = {data.buf, (const uint8_t *)data.buf + data.len};
    uint64_t n = 0, read = 0;
    if (roles == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int c = 0; c < 5; c++)
        if (at[c] >= 0 && at[c] < length)
            roles[at[c]] = (uint8_t)(REQUEST_ID + c);
    if (read_array(&r, &n) < 0 || n > (uint64_t)data.len) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if ((outputs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *outputs)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; read < n; read++) {  /* the first pass: every output read and checked, nothing redacted */
        int takes = read_output(&r, &outputs[read], roles, (uint64_t)length, live, ended,
                                (long)PyList_GET_SIZE(permutation));
        if (takes <= 0) {
            read++;  /* (its references, too, are released) */
            result = takes < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
    }
    if (r.p != r.end) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if ((finished = PyList_New(0)) == NULL || put_array(&w, n) < 0)
        goto done;
    for (uint64_t i = 0; i < n; i++) {  /* the second pass: each written redacted, its context moved on */
        plain_output *o = &outputs[i];
        if (o->has_finish && PyList_Append(finished, o->rid) < 0)
            goto done;
        if (put_array(&w, (uint64_t)length) < 0)
            goto done;
        for (Py_ssize_t k = 0; k < length; k++) {
            int failed = 0;
            PyObject *text = NULL;
            switch (roles[k]) {
            case NIL:
                failed = put_nil(&w);
                break;
            case REQUEST_ID:
                failed = (text = hashed(o->rid, known, hasher)) == NULL || put_str(&w, text) < 0;
                break;
            case TOKENS:
                failed = put_tokens(&w, o, o->fixed, permutation);
                break;
            case FINISH_REASON:
                failed = o->has_finish ? put_int(&w, o->finish) : put_nil(&w);
                break;
            case STOP_REASON:
                if (o->stop != NULL)
                    failed = (text = hashed(o->stop, known, hasher)) == NULL || put_str(&w, text) < 0;
                else
                    failed = o->has_stop_int ? put_int(&w, o->stop_int) : put_nil(&w);
                break;
            case NANS:
                failed = put_int(&w, o->nans);
                break;
            }
            Py_XDECREF(text);
            if (failed)
                goto done;
        }
    }
    result = Py_BuildValue("(y#O)", (const char *)w.data, (Py_ssize_t)w.size, finished);
done:
    Py_XDECREF(finished);
    if (outputs != NULL)
        release_outputs(outputs, read);
    PyMem_Free(roles);
    PyMem_Free(w.data);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Tokens chained in their context (see the module's comment)."},
    {"unchanged", unchanged, METH_VARARGS, "Whether the walk gives a struct's msgpack back as it is (see above)."},
    {"outputs", redact_outputs, METH_VARARGS, "A busy engine's outputs, redacted (see the module's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) {
    prefix_name = PyUnicode_InternFromString("prefix");
    fixed_name = PyUnicode_InternFromString("fixed");
    if (prefix_name == NULL || fixed_name == NULL || PyType_Ready(&PrefixType) < 0 || PyType_Ready(&ShapeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObjectRef(m, "Prefix", (PyObject *)&PrefixType) < 0
                      || PyModule_AddObjectRef(m, "Shape", (PyObject *)&ShapeType) < 0))
        Py_CLEAR(m);
    return m;
}
