/* _ready.h: the ready book's object (kvshare._ready.Book) and its extend step, shared with
 * kvshare._select, which reads the book while it ranks (router.ready.ReadyBlocks.extend). */
#ifndef KVSHARE_READY_H
#define KVSHARE_READY_H

#include "_books.h"

typedef struct {
    PyObject_HEAD
    BkTable t;        /* payload: t = when stored, a = worker id, b = others can pull it */
    Py_ssize_t max;
    uint64_t calls;
    long local_src, remote_src;
    PyObject *ns_ids, *ns_names, *w_ids, *w_names;
} ReadyBook;

typedef struct {
    long src;
    Py_ssize_t n;
} SrcRun;

/* ReadyBlocks.extend's walk: from block ``covered`` on, the blocks worker ``w`` will hold or
 * reach when it starts at ``start_s`` are appended to ``buf[0 .. *n_out)`` (runs merged), and
 * ``*begin`` raised to the latest end of its own jobs among them; returns the first block not
 * reached (-1 with an exception set). ``buf`` has room for every block of ``items``. */
static inline Py_ssize_t ready_extend(const ReadyBook *book, uint32_t ns, int32_t w, PyObject **items,
                               Py_ssize_t n, Py_ssize_t covered, double now, double start_s,
                               SrcRun *buf, Py_ssize_t *n_out, double *begin)
{
    Py_ssize_t k = covered;
    for (; k < n; k++) {
        const uint8_t *key;
        Py_ssize_t klen;
        if (bk_key(items[k], &key, &klen) < 0)
            return -1;
        int32_t i = bk_find(&book->t, ns, key, klen);
        if (i == BK_NONE)
            break;
        const BkEntry *e = &book->t.e[i];
        if (!(now < e->t))
            break;
        long src;
        if (e->a == w) {
            src = book->local_src;
            if (e->t > *begin)
                *begin = e->t;
        } else if (e->b && e->t <= start_s) {
            src = book->remote_src;
        } else {
            break;
        }
        if (*n_out && buf[*n_out - 1].src == src)
            buf[*n_out - 1].n++;
        else
            buf[(*n_out)++] = (SrcRun){src, 1};
    }
    return k;
}

#endif
