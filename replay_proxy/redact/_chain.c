/* The token chain of TokenMap.chain (tokens.py), in C, and with it a busy engine's outputs redacted:
 * the loop of Redactor._plain_outputs (frames.py).
 *
 * Prefix: a running keyed BLAKE2b, as hashlib.blake2b (copy, update, digest) but with its state in plain
 * memory (blake2b.h), which the chain finalizes per token on the stack: no call, no bytes object.
 *
 * chain: each token mapped in its context, the running hash of the tokens before it: its digest gives
 * the shift, then the token's 4 bytes extend it. TokenMap holds the construction; this only runs it, a
 * prompt of thousands of tokens at each ADD.
 *
 * outputs: at 2,000 steps a second of 32 outputs, the Python loop's own overhead (a few microseconds an
 * output, most of it not the hashing) was the redactor's largest cost. This does the same per output, in
 * place (the caller decoded the outputs for this): its request id hashed (from the hasher's cache, else
 * by calling it), its tokens chained in their request's context, the stop reason hashed if it is text.
 * Every output is checked first (context_of); if any is not one it takes, it returns None before
 * touching an output or a context, and the caller walks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "blake2b.h"

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

/* The tokens of the list ``tokens`` (ints in the vocabulary: checked by the caller) chained after
 * ``prefix``, which they extend, into the list ``out`` of the same length (which may be ``tokens``);
 * the state before each appended to ``states`` unless it is NULL. 0, or -1 with an exception set. */
static int chain_into(Prefix *prefix, PyObject *tokens, PyObject *out, PyObject *fixed, PyObject *permutation,
                      PyObject *states) {
    long size = (long)PyList_GET_SIZE(permutation);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tokens); j++) {
        PyObject *original = PyList_GET_ITEM(tokens, j), *state = NULL;
        long token = PyLong_AsLong(original);
        uint64_t shift;
        if (shift_of(&prefix->state, &shift, states == NULL ? NULL : &state) < 0)
            return -1;
        if (state != NULL) {
            int appended = PyList_Append(states, state);
            Py_DECREF(state);
            if (appended < 0)
                return -1;
        }
        const uint8_t bytes[4] = {(uint8_t)token, (uint8_t)(token >> 8), (uint8_t)(token >> 16), (uint8_t)(token >> 24)};
        blake2b_update(&prefix->state, bytes, 4);  /* the token's 4 bytes, little-endian */
        PyObject *pseudonym = mapped(original, token, shift, fixed, permutation, size);
        if (pseudonym == NULL)
            return -1;
        if (out == tokens)
            PyList_SetItem(out, j, pseudonym);  /* (the original's reference dropped) */
        else
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

/* The context of an output that the fast path takes, or NULL (no exception set) if it takes none: a list
 * of the release's length, nil where the fast path has no column, with a text id of a request known,
 * a list of ids in the vocabulary, an int NaN count, a finish reason nil or int, a stop reason nil, int
 * or text. */
static PyObject *context_of(PyObject *value, Py_ssize_t length, PyObject *nil, Py_ssize_t *at, PyObject *live,
                            PyObject *ended, long size) {
    if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) != length)
        return NULL;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(nil); k++)
        if (PyList_GET_ITEM(value, PyLong_AsSsize_t(PyTuple_GET_ITEM(nil, k))) != Py_None)
            return NULL;
    PyObject *rid = PyList_GET_ITEM(value, at[0]), *tokens = PyList_GET_ITEM(value, at[1]);
    PyObject *finish = PyList_GET_ITEM(value, at[2]), *stop = PyList_GET_ITEM(value, at[3]);
    if (!PyUnicode_CheckExact(rid) || !PyList_CheckExact(tokens) || !PyLong_CheckExact(PyList_GET_ITEM(value, at[4]))
            || !(finish == Py_None || PyLong_CheckExact(finish))
            || !(stop == Py_None || PyLong_CheckExact(stop) || PyUnicode_CheckExact(stop)))
        return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tokens); j++) {
        PyObject *token = PyList_GET_ITEM(tokens, j);
        if (!PyLong_CheckExact(token))
            return NULL;
        int overflow = 0;
        long t = PyLong_AsLongAndOverflow(token, &overflow);
        if (overflow || t < 0 || t >= size)
            return NULL;
    }
    PyObject *context = PyDict_GetItemWithError(live, rid);
    if (context == NULL && !PyErr_Occurred())
        context = PyDict_GetItemWithError(ended, rid);
    return context;
}

/* outputs(outputs, length, nil, columns, live, ended, hasher, known, permutation)
 *   -> the ids of the requests that finished, the outputs redacted in place; or None if any is not one the
 *   fast path takes (before anything is redacted). */
static PyObject *redact_outputs(PyObject *module, PyObject *args) {
    PyObject *outputs, *nil, *live, *ended, *hasher, *known, *permutation;
    Py_ssize_t length, at[5];  /* request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits */
    if (!PyArg_ParseTuple(args, "O!nO!(nnnnn)O!O!OO!O!", &PyList_Type, &outputs, &length, &PyTuple_Type, &nil,
                          &at[0], &at[1], &at[2], &at[3], &at[4], &PyDict_Type, &live, &PyDict_Type, &ended, &hasher,
                          &PyDict_Type, &known, &PyList_Type, &permutation))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(outputs), rid_at = at[0], tokens_at = at[1], stop_at = at[3];
    long size = (long)PyList_GET_SIZE(permutation);
    PyObject *prefixes = PyList_New(n), *fixeds = PyList_New(n);  /* each output's context: checked first */
    if (prefixes == NULL || fixeds == NULL)
        goto fail_early;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *context = context_of(PyList_GET_ITEM(outputs, i), length, nil, at, live, ended, size);
        if (context == NULL) {
            Py_DECREF(prefixes);
            Py_DECREF(fixeds);
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
        PyObject *prefix = PyObject_GetAttr(context, prefix_name), *fixed = PyObject_GetAttr(context, fixed_name);
        PyList_SET_ITEM(prefixes, i, prefix);
        PyList_SET_ITEM(fixeds, i, fixed);
        if (prefix == NULL || fixed == NULL)
            goto fail_early;
        if (!PyAnySet_Check(fixed) || !PyObject_TypeCheck(prefix, &PrefixType)) {
            PyErr_SetString(PyExc_TypeError, "a context's prefix is not a Prefix, or its fixed tokens not a set");
            goto fail_early;
        }
    }
    PyObject *finished = PyList_New(0);
    if (finished == NULL)
        goto fail_early;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyList_GET_ITEM(outputs, i), *prefix = PyList_GET_ITEM(prefixes, i);
        PyObject *fixed = PyList_GET_ITEM(fixeds, i), *tokens = PyList_GET_ITEM(value, tokens_at);
        PyObject *original_rid = PyList_GET_ITEM(value, rid_at);
        if (PyList_GET_ITEM(value, at[2]) != Py_None && PyList_Append(finished, original_rid) < 0)
            goto fail;
        PyObject *rid = hashed(original_rid, known, hasher);
        if (rid == NULL)
            goto fail;
        PyList_SetItem(value, rid_at, rid);
        PyObject *stop = PyList_GET_ITEM(value, stop_at);
        if (PyUnicode_CheckExact(stop)) {
            PyObject *stop_hashed = hashed(stop, known, hasher);
            if (stop_hashed == NULL)
                goto fail;
            PyList_SetItem(value, stop_at, stop_hashed);
        }
        if (chain_into((Prefix *)prefix, tokens, tokens, fixed, permutation, NULL) < 0)
            goto fail;
    }
    Py_DECREF(prefixes);
    Py_DECREF(fixeds);
    return finished;
fail:
    Py_DECREF(finished);
fail_early:
    Py_XDECREF(prefixes);
    Py_XDECREF(fixeds);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Tokens chained in their context (see the module's comment)."},
    {"outputs", redact_outputs, METH_VARARGS, "A busy engine's outputs, redacted (see the module's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) {
    prefix_name = PyUnicode_InternFromString("prefix");
    fixed_name = PyUnicode_InternFromString("fixed");
    if (prefix_name == NULL || fixed_name == NULL || PyType_Ready(&PrefixType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Prefix", (PyObject *)&PrefixType) < 0)
        Py_CLEAR(m);
    return m;
}
