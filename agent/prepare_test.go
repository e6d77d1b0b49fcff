package agent

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

const (
	prepWhole = `version: v1
configs:
  default: {}
`
	prepSliced = `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
`
	prepOnDemand = `version: v1
configs:
  default:
    dra:
      migOnDemand: {enabled: true}
`
)

// prepNode is an agent with DRA on a simulated node under a config, and
// the actuators a Prepare may use, each recording what it is asked.
type prepNode struct {
	h     *harness
	rec   *draRecorder
	ts    *slicer
	mps   *setMPS
	gpus0 int // MIG devices NVML lists on GPU 0 before deciding
}

func newPrepNode(t *testing.T, profile, yaml string, opts ...sim.Option) *prepNode {
	t.Helper()
	p := &prepNode{rec: &draRecorder{}, ts: &slicer{}, mps: &setMPS{}}
	p.h = newHarness(t, simNode(t, profile, opts...), withDRA(p.rec), withMIG(), withCDI(t.TempDir()),
		func(h *harness) { h.opts.MPS, h.opts.TimeSlice = p.mps, p.ts })
	p.h.config(yaml)
	return p
}

// decide is the decision for c's first request, as prepareClaim makes it
// when c has got pc so far.
func (p *prepNode) decide(t *testing.T, c dra.Claim, pc PreparedClaim) (devicePlan, error) {
	t.Helper()
	pool := p.rec.last()
	sharings, err := claimSharings(c, pool)
	if err != nil {
		t.Fatal(err)
	}
	inv, err := p.h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	p.gpus0 = len(inv.GPUs[0].Instances)
	return p.h.a.decideDevice(c, c.Devices[0], sharings[0], pool, pc, 0)
}

// untouched fails t if deciding did anything: a MIG device made, an intent
// recorded, a time slice set, an MPS daemon asked for.
func (p *prepNode) untouched(t *testing.T) {
	t.Helper()
	inv, err := p.h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(inv.GPUs[0].Instances); n != p.gpus0 {
		t.Errorf("GPU 0 has %d MIG devices after deciding, had %d", n, p.gpus0)
	}
	if n := len(p.h.a.ledger.Intents()); n != 0 {
		t.Errorf("%d intents in the ledger after deciding", n)
	}
	if len(p.ts.set) != 0 || len(p.mps.daemons) != 0 || len(p.h.a.mpsPending) != 0 {
		t.Errorf("time slices %v, daemons %v, pending %v after deciding; want none", p.ts.set, p.mps.daemons, p.h.a.mpsPending)
	}
}

// TestDecideDevice: what a claim's request gets is decided before anything
// is made for it, and the decision alone touches nothing.
func TestDecideDevice(t *testing.T) {
	tests := []struct {
		name    string
		profile string
		sim     []sim.Option
		config  string
		// claim is the claim asked, pc what it got so far; setup prepares
		// what is there before (nil: nothing).
		claim   func(p *prepNode) (dra.Claim, PreparedClaim)
		setup   func(t *testing.T, p *prepNode)
		wantErr string
		check   func(t *testing.T, p *prepNode, d devicePlan)
	}{
		{
			name: "a whole GPU: the device as it is, nothing to make or set", profile: "pcie-4gpu", config: prepWhole,
			claim: func(*prepNode) (dra.Claim, PreparedClaim) { return claim("uid-w", "w", "gpu-1"), PreparedClaim{} },
			check: func(t *testing.T, p *prepNode, d devicePlan) {
				g, _ := p.rec.last().Device("gpu-1")
				if d.Device.UUID != g.UUID || len(d.Device.CDIDevices) != 1 || d.Device.CDIDevices[0] != g.CDIDevice() {
					t.Errorf("device %+v, want gpu-1 (%s) by its CDI name", d.Device, g.UUID)
				}
				if d.Partition != nil || d.Interval != "" || d.Daemon != nil || d.CDI != nil {
					t.Errorf("plan %+v, want nothing made or set", d)
				}
			},
		},
		{
			name: "a device the pool does not offer", profile: "pcie-4gpu", config: prepWhole,
			claim:   func(*prepNode) (dra.Claim, PreparedClaim) { return claim("uid-x", "x", "gpu-9"), PreparedClaim{} },
			wantErr: `device "gpu-9" is not offered`,
		},
		{
			name: "a device another claim holds", profile: "pcie-4gpu", config: prepWhole,
			setup: func(t *testing.T, p *prepNode) {
				if got := p.h.prepare(claim("uid-a", "a", "gpu-1"))["uid-a"]; got.Err != nil {
					t.Fatal(got.Err)
				}
			},
			claim:   func(*prepNode) (dra.Claim, PreparedClaim) { return claim("uid-b", "b", "gpu-1"), PreparedClaim{} },
			wantErr: "is in use by",
		},
		{
			name: "a claim's time slice: decided, not set", profile: "pcie-4gpu", config: prepSliced,
			claim: func(*prepNode) (dra.Claim, PreparedClaim) {
				c := claim("uid-t", "t", "gpu-1")
				c.Devices[0].ShareID = types.UID("share-t")
				return withConfig(c, fromClaim, gpuTSLong), PreparedClaim{}
			},
			check: func(t *testing.T, p *prepNode, d devicePlan) {
				if d.Interval != devicemodel.IntervalLong || d.Device.Interval != devicemodel.IntervalLong || d.Device.Shares != 1 {
					t.Errorf("plan %+v, want interval Long recorded with one share", d)
				}
			},
		},
		{
			name: "the claim's own MPS daemon: its limits, its CDI device, not started", profile: "pcie-4gpu", config: prepWhole,
			claim: func(*prepNode) (dra.Claim, PreparedClaim) {
				return withConfig(claim("uid-m", "m", "gpu-1", "gpu-2"), fromClaim, gpuMPS), PreparedClaim{}
			},
			check: func(t *testing.T, p *prepNode, d devicePlan) {
				g, _ := p.rec.last().Device("gpu-1")
				if d.Daemon == nil || d.Daemon.Device != g.UUID || d.Daemon.ActiveThreadPercentage != 30 || d.Daemon.PinnedMemLimitBytes != 2<<30 || d.Device.MPSDaemon == nil {
					t.Fatalf("daemon %+v, want gpu-1's at 30%% and 2Gi, recorded", d.Daemon)
				}
				name := cdi.ClaimDeviceName("uid-m", 0)
				if d.CDI == nil || d.CDI.Name != name || d.CDI.Env["CUDA_MPS_PIPE_DIRECTORY"] == "" {
					t.Errorf("CDI device %+v, want %s with the pipe directory", d.CDI, name)
				}
				if len(d.Device.CDIDevices) != 2 || d.Device.CDIDevices[1] != cdi.QualifiedName(name) {
					t.Errorf("CDI names %v, want the GPU's and %s", d.Device.CDIDevices, name)
				}
			},
		},
		{
			name: "a MIG device on demand on an idle GPU: MIG on, then the instance, nothing made", profile: "dgx-h100",
			sim: []sim.Option{sim.WithImmediateMIGModeChange()}, config: prepOnDemand,
			claim: func(*prepNode) (dra.Claim, PreparedClaim) {
				return claim("uid-3g", "three", "gpu-0-mig-3g40gb-4"), PreparedClaim{}
			},
			check: func(t *testing.T, p *prepNode, d devicePlan) {
				pp := d.Partition
				if pp == nil || !pp.TurnsMIGOn || pp.GPU.Index != 0 {
					t.Fatalf("partition %+v, want one on GPU 0 that turns MIG on", pp)
				}
				steps := pp.Plan.Steps
				if len(steps) != 2 || steps[0].Op != mig.OpSetMode || steps[1].Op != mig.OpCreate || steps[1].Profile != "3g.40gb" || steps[1].Placement.Start != 4 {
					t.Errorf("steps %v, want MIG on, then 3g.40gb at 4", steps)
				}
				if pp.Plan.Want.Counts["3g.40gb"] != 1 || len(pp.Plan.Want.Counts) != 1 {
					t.Errorf("wants %v, want one 3g.40gb", pp.Plan.Want.Counts)
				}
				if in := d.Device; !in.Created || in.Parent != pp.GPU.UUID || in.UUID != "" || in.Device != "gpu-0-mig-3g40gb-4" {
					t.Errorf("intent %+v, want gpu-0-mig-3g40gb-4 to be made on GPU 0", in)
				}
			},
		},
		{
			name: "a MIG device on demand where one is: refused before anything is made", profile: "dgx-h100",
			sim: []sim.Option{sim.WithImmediateMIGModeChange()}, config: prepOnDemand,
			setup: func(t *testing.T, p *prepNode) {
				if got := p.h.prepare(claim("uid-4g", "four", "gpu-0-mig-4g40gb-0"))["uid-4g"]; got.Err != nil {
					t.Fatal(got.Err)
				}
			},
			claim: func(*prepNode) (dra.Claim, PreparedClaim) {
				return claim("uid-7g", "seven", "gpu-0-mig-7g80gb-0"), PreparedClaim{}
			},
			wantErr: "already occupies",
		},
		{
			name: "admin access to a MIG device not made: refused, none is made", profile: "dgx-h100",
			sim: []sim.Option{sim.WithImmediateMIGModeChange()}, config: prepOnDemand,
			claim: func(*prepNode) (dra.Claim, PreparedClaim) {
				c := claim("uid-adm", "adm", "gpu-0-mig-3g40gb-4")
				c.Devices[0].AdminAccess = true
				return c, PreparedClaim{}
			},
			wantErr: "admin access creates none",
		},
		{
			name: "a GPU and one of its MIG devices in one claim", profile: "dgx-h100",
			sim: []sim.Option{sim.WithImmediateMIGModeChange()}, config: prepOnDemand,
			claim: func(p *prepNode) (dra.Claim, PreparedClaim) {
				g, _ := p.rec.last().Device("gpu-0")
				got := PreparedClaim{Devices: []PreparedClaimDevice{{PreparedDevice: dra.PreparedDevice{Device: "gpu-0"}, UUID: g.UUID}}}
				return claim("uid-2", "two", "gpu-0-mig-3g40gb-4"), got
			},
			wantErr: "of the same claim are the same GPU",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPrepNode(t, tt.profile, tt.config, tt.sim...)
			if tt.setup != nil {
				tt.setup(t, p)
			}
			intents := len(p.h.a.ledger.Intents())
			if intents != 0 {
				t.Fatalf("%d intents before deciding", intents)
			}
			c, pc := tt.claim(p)
			d, err := p.decide(t, c, pc)
			p.untouched(t)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("decision %+v, error %v; want an error with %q", d, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, p, d)
		})
	}
}

// TestPartitionRollback: a MIG device that cannot be made safely (its
// intent cannot be checkpointed) leaves neither the intent nor the GPU's
// on-demand mark behind, and NVML untouched.
func TestPartitionRollback(t *testing.T) {
	p := newPrepNode(t, "dgx-h100", prepOnDemand, sim.WithImmediateMIGModeChange())
	c := claim("uid-3g", "three", "gpu-0-mig-3g40gb-4")
	d, err := p.decide(t, c, PreparedClaim{})
	if err != nil || d.Partition == nil {
		t.Fatalf("decision %+v, %v; want a partition", d, err)
	}
	p.h.a.opts.StateDir = "/nonexistent/state" // the checkpoint fails
	if _, err := p.h.a.makeDevice(c, c.Devices[0], d); err == nil || !strings.Contains(err.Error(), "could not be checkpointed first") {
		t.Fatalf("made with no checkpoint: %v", err)
	}
	p.untouched(t)
	if p.h.a.ledger.Dynamic(d.Partition.GPU.UUID) {
		t.Errorf("GPU 0 still marked as turned to MIG for claims")
	}
}
