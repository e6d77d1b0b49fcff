package agent

import (
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// statusRecorder is the claim status writer as the loop sees it.
type statusRecorder struct {
	mu   sync.Mutex
	sets []map[types.UID]dra.ClaimStatus
}

func (r *statusRecorder) Set(c map[types.UID]dra.ClaimStatus) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sets = append(r.sets, c)
}

func (r *statusRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sets)
}

func (r *statusRecorder) last() map[types.UID]dra.ClaimStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.sets) == 0 {
		return nil
	}
	return r.sets[len(r.sets)-1]
}

// The claim statuses the loop hands the writer: Ready devices once
// prepared (with the UUID, and a made MIG device's placement), the health
// cause when a device turns unhealthy, nothing once released; unchanged
// statuses are not handed again.
func TestClaimStatusFollowsClaimsAndHealth(t *testing.T) {
	rec, st := &draRecorder{}, &statusRecorder{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(rec), withMIG(),
		func(h *harness) { h.opts.ClaimStatus = st })
	h.config(migOnDemand)
	if got := st.last(); len(got) != 0 {
		t.Fatalf("claim statuses before any claim: %+v", got)
	}
	if a := h.prepare(claim("uid-w", "whole", "gpu-1"), claim("uid-m", "made", "gpu-0-mig-3g40gb-4")); a["uid-w"].Err != nil || a["uid-m"].Err != nil {
		t.Fatalf("prepare: %+v", a)
	}
	got := st.last()
	w, m := got["uid-w"], got["uid-m"]
	gpu1 := findGPU(h, 1).ID
	if w.Name != "whole" || w.Namespace != "default" || len(w.Devices) != 1 || w.Devices[0].Device != "gpu-1" ||
		w.Devices[0].Unhealthy != "" || w.Devices[0].Data["uuid"] != gpu1 {
		t.Errorf("whole GPU claim's status %+v, want gpu-1 ready with UUID %s", w, gpu1)
	}
	if len(m.Devices) != 1 {
		t.Fatalf("MIG claim's status %+v", m)
	}
	md := m.Devices[0]
	place, _ := md.Data["placement"].(map[string]any)
	if uuid, _ := md.Data["uuid"].(string); !strings.HasPrefix(uuid, "MIG-") || md.Data["profile"] != "3g.40gb" ||
		md.Data["parentUUID"] != findGPU(h, 0).ID || place["start"] != 4 || place["size"] != 4 || md.Unhealthy != "" {
		t.Errorf("made MIG device's status %+v, want its MIG UUID, parent, profile and placement 4+4", md)
	}

	// Nothing changed: not handed again.
	n := st.count()
	h.step(Tick{})
	if st.count() != n {
		t.Errorf("unchanged statuses handed again")
	}

	// A fatal XID on GPU 1: its claim's device says why.
	h.step(HealthChanged{State: xidState(gpu1, 48)})
	if d := st.last()["uid-w"].Devices[0]; !strings.Contains(d.Unhealthy, "48") {
		t.Errorf("after XID 48 on GPU 1: %+v, want the cause", d)
	}
	if d := st.last()["uid-m"].Devices[0]; d.Unhealthy != "" {
		t.Errorf("the XID on GPU 1 marked GPU 0's MIG device: %+v", d)
	}

	h.unprepare(dra.ClaimRef{UID: "uid-w", Namespace: "default", Name: "whole"})
	if got := st.last(); len(got) != 1 || got["uid-m"].Name != "made" {
		t.Errorf("after releasing whole: %+v, want only made's", got)
	}
}
