package mig

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// refusingGuard refuses every device in refuse and records what it was
// asked.
type refusingGuard struct {
	refuse []string
	asked  [][]string
}

func (g *refusingGuard) Doom(uuids []string, why string) error {
	g.asked = append(g.asked, slices.Clone(uuids))
	for _, u := range uuids {
		if slices.Contains(g.refuse, u) {
			return errors.New(u + " is held by a test")
		}
	}
	return nil
}

// The guard Apply is handed is asked before each destroy, and a refusal
// leaves the plan pending there with the device in place; the guard is the
// caller's, per plan, so the same applier runs another plan unguarded.
func TestApplyAsksTheGuardItIsGiven(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	r.converge(0, Want{MIGEnabled: true, Counts: map[string]int{"3g.20gb": 2}}, nil)
	held := r.gpu(0).Instances[0].UUID
	p, _, err := MakePlan(r.gpu(0), r.profiles(0), Want{MIGEnabled: true, Counts: map[string]int{"7g.40gb": 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := &refusingGuard{refuse: []string{held}}
	st, err := r.ap.Apply(context.Background(), p, g)
	if err != nil || st.Phase != PhasePending {
		t.Fatalf("Apply with a guard refusing %s = %+v, %v; want pending", held, st, err)
	}
	if !slices.ContainsFunc(g.asked, func(us []string) bool { return slices.Contains(us, held) }) {
		t.Errorf("the guard was asked %v, never about %s", g.asked, held)
	}
	if !slices.ContainsFunc(r.gpu(0).Instances, func(m gpu.MIGInstance) bool { return m.UUID == held }) {
		t.Errorf("%s destroyed although the guard refused it", held)
	}
	if st, err := r.ap.Apply(context.Background(), p, nil); err != nil || st.Phase != PhaseApplied {
		t.Fatalf("Apply without a guard = %+v, %v; want applied", st, err)
	}
}
