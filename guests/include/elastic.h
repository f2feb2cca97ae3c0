/* kumo's elastic channel (issue 13): one 4 KiB mailbox page at the GPA in
 * kumo_boot_info.elastic, an interrupt (KUMO_ELASTIC_VECTOR) after kumo writes a request, and a
 * doorbell port write after the guest acks one. The contract is
 * helper-notes/elastic-spec.md; the host side mirrors this layout byte for byte. */
#ifndef KUMO_ELASTIC_H
#define KUMO_ELASTIC_H

#include "kumo.h"

#define KUMO_ELASTIC_MAGIC 0x444e454c4f4d554bUL /* "KUMOLEND" */
#define KUMO_ELASTIC_VERSION 1
#define KUMO_ELASTIC_VECTOR 0x31
#define KUMO_ELASTIC_PORT 0x510
#define KUMO_ELASTIC_MAX_AREAS 8
#define KUMO_ELASTIC_MAX_BLOCKS 1024 /* bitmaps below: 16 x u64 */
#define KUMO_ELASTIC_MAX_CPUS 64

enum { KUMO_OP_NONE = 0, KUMO_OP_VACATE_CPUS = 1, KUMO_OP_GIVE_CPUS = 2,
       KUMO_OP_RELEASE_MEM = 3, KUMO_OP_GIVE_MEM = 4, KUMO_OP_CANCEL = 5 };
enum { KUMO_ACK_OK = 0, KUMO_ACK_REFUSED = 1 };

struct kumo_elastic_area { /* one guest NUMA node's elastic memory */
    u64 base;              /* GPA of its first block (2 MiB aligned) */
    u32 first_block;       /* global index of its first block */
    u32 nblocks;
    u32 node;              /* guest NUMA node */
    u32 _pad;
};

struct kumo_elastic {
    /* written by kumo once, before the guest starts */
    u64 magic;
    u32 version;
    u32 ncpus;
    u64 block_bytes;       /* a multiple of 2 MiB */
    u32 nareas;
    u32 nblocks;           /* total over all areas, <= KUMO_ELASTIC_MAX_BLOCKS */
    struct kumo_elastic_area areas[KUMO_ELASTIC_MAX_AREAS];
    /* written by kumo: the grant and one request at a time */
    u64 cpus_allowed;      /* vCPUs the guest may run work on (bit v = vCPU v) */
    u64 mem_plugged[16];   /* blocks the guest may use (bit b = global block b) */
    u32 seq;               /* bumped after every other request field is written */
    u32 op;                /* KUMO_OP_* of request `seq` */
    u64 req_cpus;          /* VACATE_CPUS / GIVE_CPUS: those vCPUs */
    u32 req_node;          /* RELEASE_MEM: guest node to give blocks up from */
    u32 req_blocks;        /* RELEASE_MEM: how many blocks */
    u64 req_mem[16];       /* GIVE_MEM: the blocks given (already set in mem_plugged) */
    /* written by the guest */
    u32 ack_seq;           /* = seq once request `seq` is done (then the doorbell) */
    u32 ack_status;        /* KUMO_ACK_* */
    u64 ack_mem[16];       /* RELEASE_MEM: the blocks given up (exactly req_blocks) */
    u32 cpu_state[KUMO_ELASTIC_MAX_CPUS]; /* per vCPU: 0 idle (halted, no work), 1 working */
    u64 progress[KUMO_ELASTIC_MAX_CPUS];  /* per vCPU: work units done so far (only grows) */
};

#define KUMO_ELASTIC_AT(field, off) \
    _Static_assert(__builtin_offsetof(struct kumo_elastic, field) == (off), "elastic layout: " #field)
_Static_assert(sizeof(struct kumo_elastic_area) == 24, "elastic layout: area");
_Static_assert(__builtin_offsetof(struct kumo_elastic_area, base) == 0, "elastic layout: area.base");
_Static_assert(__builtin_offsetof(struct kumo_elastic_area, first_block) == 8, "elastic layout: area.first_block");
_Static_assert(__builtin_offsetof(struct kumo_elastic_area, nblocks) == 12, "elastic layout: area.nblocks");
_Static_assert(__builtin_offsetof(struct kumo_elastic_area, node) == 16, "elastic layout: area.node");
KUMO_ELASTIC_AT(magic, 0);
KUMO_ELASTIC_AT(version, 8);
KUMO_ELASTIC_AT(ncpus, 12);
KUMO_ELASTIC_AT(block_bytes, 16);
KUMO_ELASTIC_AT(nareas, 24);
KUMO_ELASTIC_AT(nblocks, 28);
KUMO_ELASTIC_AT(areas, 32);
KUMO_ELASTIC_AT(cpus_allowed, 224);
KUMO_ELASTIC_AT(mem_plugged, 232);
KUMO_ELASTIC_AT(seq, 360);
KUMO_ELASTIC_AT(op, 364);
KUMO_ELASTIC_AT(req_cpus, 368);
KUMO_ELASTIC_AT(req_node, 376);
KUMO_ELASTIC_AT(req_blocks, 380);
KUMO_ELASTIC_AT(req_mem, 384);
KUMO_ELASTIC_AT(ack_seq, 512);
KUMO_ELASTIC_AT(ack_status, 516);
KUMO_ELASTIC_AT(ack_mem, 520);
KUMO_ELASTIC_AT(cpu_state, 648);
KUMO_ELASTIC_AT(progress, 904);
_Static_assert(sizeof(struct kumo_elastic) == 1416, "elastic layout: size");
_Static_assert(__builtin_offsetof(struct kumo_boot_info, elastic) == 72, "boot info: elastic at 72");

#endif
