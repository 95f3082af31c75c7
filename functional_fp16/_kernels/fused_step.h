/* The calling convention of the fused steps that run through the generic C++ op
 * functional_fp16_cpu::step (fused_ops.cpp): one argument block per call.
 *
 * Leaf l (of n_leaves) belongs to group l / (n_leaves / n_groups), as in
 * fused_step.c. An optimiser with n_states per-parameter float32 states reads
 * state j of leaf l at s[j][l] and writes it at so[j][l]; every per-group
 * scalar is an array of n_groups entries; hyper holds its fixed
 * hyperparameters in the order its StepSpec declares them (_fused/<name>.py).
 * Outputs equal to inputs (mo[l] == m[l]) mean a donated step, written in
 * place; po[l] == mo[l] marks a leaf whose working copy is its master. A
 * skipped group (apply[k] == 0) leaves its outputs equal to its inputs, bit
 * for bit.
 *
 * Adding an optimiser: write `void ff_<name>_step(const ff_step_args *)` in
 * fused_step.c and add it to the table that ff_step_entry reads.
 */
#ifndef FUNCTIONAL_FP16_FUSED_STEP_H
#define FUNCTIONAL_FP16_FUSED_STEP_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t n_leaves, n_groups;
    int32_t n_states, n_scalars, n_hyper, threads;
    void *const *g;          /* gradients, dtype codes gdt */
    float *const *m;         /* float32 masters */
    float *const *const *s;  /* s[j][l]: state j of leaf l */
    void *const *p;          /* working copies, dtype codes pdt */
    float *const *mo;
    float *const *const *so;
    void *const *po;
    const int64_t *numel;
    const int32_t *gdt, *pdt;
    const float *inv;        /* NULL: a unit scale */
    const float *clip_div;   /* NULL (with clip_mul): no clipping */
    const float *clip_mul;
    const float *lr;         /* the signed step factor */
    const uint8_t *apply;
    const float *const *scalars; /* scalars[j][k]: the optimiser's per-group scalar j */
    const double *hyper;
    /* Stored states (steps that keep their states in fewer bits; unused by the others):
     * sdt[j][l] how state j of leaf l is stored (fused_step.c's ST_* codes), sc[j][l] and
     * sco[j][l] its block scales in and out where it is block-coded; rows[l] a leaf's
     * first dimension (1 for a vector), salt_ids[l] (for the leaves of one member) its
     * index in the optimiser's tree, counts[k] group k's step count: the stochastic
     * rounding's salt. */
    const int32_t *const *sdt;
    float *const *const *sc;
    float *const *const *sco;
    const int64_t *rows;
    const int64_t *salt_ids;
    const int64_t *counts;
    int64_t block_size, n_members;
    int32_t rounding; /* 0: to nearest; 1: stochastic */
    int32_t root;     /* the second state is coded through its square root */
    /* The master is split (master_split.py): m[l] and mo[l] hold int16 residuals of the
     * FP16 working copies p[l] and po[l], joined before and split after the step. */
    int32_t split;
} ff_step_args;

typedef void (*ff_step_fn)(const ff_step_args *);

/* The step named `name` ("lion", ...), or NULL. */
ff_step_fn ff_step_entry(const char *name);

/* The number of state lists the step named `name` takes (at least, at most) and of its
 * hyperparameters (-1: checked by its own op); 0 where there is no such step. */
int ff_step_arity(const char *name, int32_t *min_states, int32_t *max_states,
                  int32_t *n_hyper);

#ifdef __cplusplus
}
#endif

#endif
