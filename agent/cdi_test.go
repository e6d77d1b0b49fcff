package agent

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// withCDI gives the agent a CDI keeper writing under dir.
func withCDI(dir string) harnessOption {
	return func(h *harness) {
		w, err := cdi.NewWriter(dir)
		if err != nil {
			h.t.Fatal(err)
		}
		h.opts.CDI = &cdi.Keeper{W: w}
	}
}

// specNames reads the node's CDI spec and returns its device names; nil
// when there is no spec file.
func specNames(t *testing.T, dir string) []string {
	t.Helper()
	data, err := os.ReadFile(dir + "/" + cdi.NodeSpec + ".json")
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var s specs.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	if s.Kind != "nvidia.com/gpu" {
		t.Errorf("spec kind %q, want nvidia.com/gpu", s.Kind)
	}
	var names []string
	for _, d := range s.Devices {
		names = append(names, d.Name)
	}
	return names
}

func cdiConfig(strategy string) string {
	return "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      deviceListStrategy: " + strategy + "\n"
}

// The spec exists while the config's device list strategy uses CDI, lists
// every GPU by UUID and index, follows the MIG layout, and stays when the
// strategy no longer uses CDI.
func TestCDISpecFollowsConfigAndLayout(t *testing.T) {
	dir := t.TempDir()
	node := simNode(t, "dgx-a100", sim.WithMIGEnabled())
	h := newHarness(t, node, withCDI(dir), withMIG())
	h.config(cdiConfig("envvar"))
	if names := specNames(t, dir); names != nil {
		t.Fatalf("envvar: spec with %v written, want none", names)
	}
	if st := h.a.Status().CDI; st == nil || st.Spec != "" || st.Error != "" {
		t.Errorf("envvar: /status cdi %+v, want no spec, no error", st)
	}

	h.config(cdiConfig("cdi-cri"))
	names := specNames(t, dir)
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 2*len(inv.GPUs)+1 || !slices.Contains(names, inv.GPUs[3].UUID) || !slices.Contains(names, "3") || !slices.Contains(names, "all") {
		t.Errorf("cdi-cri: spec names %v, want each GPU by UUID and index, and all", names)
	}
	if r := h.pub.last().Resources[ResourceGPU]; r == nil || !r.Delivery.CDIOnly() {
		t.Errorf("cdi-cri: the catalog does not deliver by CDI alone: %+v", r)
	}
	if st := h.a.Status().CDI; st == nil || st.Spec != dir+"/gpu-agent.json" || st.Devices != len(names) {
		t.Errorf("/status cdi %+v, want the spec path and %d devices", st, len(names))
	}

	h.config(mixedLayout(`{"3g.20gb": 2}`) + "    devicePlugin:\n      deviceListStrategy: cdi-cri\n")
	inv, err = h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	names = specNames(t, dir)
	for _, m := range inv.GPUs[0].Instances {
		if !slices.Contains(names, m.UUID) {
			t.Errorf("MIG device %s missing from the spec %v", m.UUID, names)
		}
	}
	if !slices.Contains(names, "0:1") {
		t.Errorf("spec %v lacks the index name 0:1 of GPU 0's second MIG device", names)
	}

	// Containers given CDI names under cdi-cri resolve them again when they
	// restart: the spec stays, naming the MIG devices still there.
	h.config(cdiConfig("envvar"))
	names = specNames(t, dir)
	if !slices.Contains(names, inv.GPUs[3].UUID) || !slices.Contains(names, inv.GPUs[0].Instances[1].UUID) || !slices.Contains(names, "0:1") {
		t.Errorf("back to envvar: spec %v, want it kept", names)
	}
}

// A MIG device made on demand for a claim is in the spec before Prepare
// answers with its CDI name: the runtime resolves the name right after.
func TestCDISpecHasDynamicMIGBeforePrepareReturns(t *testing.T) {
	dir := t.TempDir()
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange()), withDRA(rec), withMIG(), withCDI(dir))
	h.config(migOnDemand)
	if names := specNames(t, dir); len(names) != 17 {
		t.Fatalf("DRA on: spec names %v, want 8 GPUs by UUID and index, and all", names)
	}
	got := h.prepare(claim("uid-1", "one", "gpu-2-mig-1g10gb-6"))["uid-1"]
	if got.Err != nil {
		t.Fatal(got.Err)
	}
	names := specNames(t, dir)
	for _, d := range got.Devices {
		for _, id := range d.CDIDevices {
			if !slices.Contains(names, id[len(cdi.Kind)+1:]) {
				t.Errorf("Prepare answered %s, which the spec %v does not define", id, names)
			}
		}
	}
	h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"})
	if names := specNames(t, dir); slices.ContainsFunc(names, func(n string) bool { return n == "2:0" }) {
		t.Errorf("released MIG device still in the spec: %v", names)
	}
}

// claimSpecEnv reads claim uid's CDI spec and returns the environment of
// its one device, and its mounts' container paths.
func claimSpecEnv(t *testing.T, dir, uid string) (map[string]string, []string) {
	t.Helper()
	data, err := os.ReadFile(dir + "/" + cdi.ClaimSpecName(uid) + ".json")
	if err != nil {
		t.Fatalf("claim %s: %v", uid, err)
	}
	var s specs.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	if len(s.Devices) != 1 || s.Kind != cdi.Kind {
		t.Fatalf("claim %s spec: %+v", uid, s)
	}
	env := map[string]string{}
	for _, kv := range s.Devices[0].ContainerEdits.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	var mounts []string
	for _, m := range s.Devices[0].ContainerEdits.Mounts {
		mounts = append(mounts, m.ContainerPath)
	}
	return env, mounts
}

// MPS through DRA: a GPU the config shares by MPS (4 replicas) is offered
// with 4 shares; each claim's containers get, through a CDI spec of the
// claim's own, the daemon's pipe directory and limits from what the claim
// consumes: 2 shares and 10 GiB give 50% of the threads and a 10240M pin.
// Unprepare removes the spec; a restart removes specs of claims it does not
// hold.
func TestDRAMPSClaimLimits(t *testing.T) {
	dir, state := t.TempDir(), t.TempDir()
	rec := &draRecorder{}
	node := simNode(t, "pcie-4gpu")
	h := newHarnessIn(t, node, state, withDRA(rec), withCDI(dir), withMPS(&fakeMPS{}))
	h.config("version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 4\n")
	d, _ := rec.last().Device("gpu-1")
	if d.Shares != 4 || !d.MPS {
		t.Fatalf("gpu-1 %+v, want 4 MPS shares", d)
	}
	mk := func(uid string, shares int64, mem uint64) dra.Claim {
		c := claim(uid, uid, "gpu-1")
		c.Devices[0].ShareID = types.UID("share-" + uid)
		c.Devices[0].SharesTaken, c.Devices[0].MemoryBytes = shares, mem
		return c
	}
	tests := []struct {
		claim      dra.Claim
		atp, limit string
	}{
		{mk("uid-big", 2, 10<<30), "50", "0=10240M"},
		{mk("uid-default", 0, 0), "25", fmt.Sprintf("0=%dM", d.MemoryBytes/4>>20)},
	}
	for _, tt := range tests {
		got := h.prepare(tt.claim)[tt.claim.UID]
		if got.Err != nil {
			t.Fatal(got.Err)
		}
		want := []string{d.CDIDevice(), cdi.QualifiedName(cdi.ClaimDeviceName(string(tt.claim.UID), 0))}
		if !slices.Equal(got.Devices[0].CDIDevices, want) {
			t.Errorf("%s: CDI devices %v, want %v", tt.claim.UID, got.Devices[0].CDIDevices, want)
		}
		env, mounts := claimSpecEnv(t, dir, string(tt.claim.UID))
		if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != tt.atp || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != tt.limit ||
			!strings.Contains(env["CUDA_MPS_PIPE_DIRECTORY"], d.UUID) {
			t.Errorf("%s: env %v, want %s%% and %s, the GPU's pipe directory", tt.claim.UID, env, tt.atp, tt.limit)
		}
		if !slices.Contains(mounts, env["CUDA_MPS_PIPE_DIRECTORY"]) {
			t.Errorf("%s: mounts %v lack the pipe directory", tt.claim.UID, mounts)
		}
	}
	h.unprepare(dra.ClaimRef{UID: "uid-big", Namespace: "default", Name: "uid-big"})
	if _, err := os.Stat(dir + "/" + cdi.ClaimSpecName("uid-big") + ".json"); !os.IsNotExist(err) {
		t.Errorf("unprepared claim's spec: %v, want it gone", err)
	}
	// A spec the ledger does not know (its claim unprepared while no agent
	// ran) goes at the next start; the held claim's stays.
	if err := os.WriteFile(dir+"/"+cdi.ClaimSpecName("uid-gone")+".json", []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	newHarnessIn(t, node, state, withDRA(&draRecorder{}), withCDI(dir), withMPS(&fakeMPS{}), withCheckpoint())
	if _, err := os.Stat(dir + "/" + cdi.ClaimSpecName("uid-gone") + ".json"); !os.IsNotExist(err) {
		t.Errorf("stale claim spec: %v, want it removed at start", err)
	}
	if _, err := os.Stat(dir + "/" + cdi.ClaimSpecName("uid-default") + ".json"); err != nil {
		t.Errorf("held claim's spec after a restart: %v", err)
	}
}

// Without CDI specs an MPS claim cannot be given its environment: Prepare
// says so rather than hand out a device without its limits.
func TestDRAMPSNeedsCDI(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec), withMPS(&fakeMPS{}))
	h.config("version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n")
	c := claim("uid-1", "one", "gpu-0")
	c.Devices[0].ShareID = "share-1"
	if got := h.prepare(c)["uid-1"]; got.Err == nil || !strings.Contains(got.Err.Error(), "--cdi-spec-dir") {
		t.Errorf("MPS claim without CDI: %+v, want an error naming --cdi-spec-dir", got)
	}
}

// Dynamic MIG, MPS and health checks at once (NVIDIA's driver refuses both
// combinations): on an H100 node whose config shares GPU 1 by MPS, a claim
// makes a MIG device on GPU 2 while another holds an MPS share of GPU 1,
// and a fatal XID on GPU 2 taints its devices.
func TestDRADynamicMIGWithMPSAndHealth(t *testing.T) {
	dir := t.TempDir()
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()),
		withDRA(rec), withMIG(), withCDI(dir), withMPS(&fakeMPS{}))
	h.config("version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true}\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          devices: [1]\n          replicas: 2\n")
	mpsClaim := claim("uid-mps", "mps", "gpu-1")
	mpsClaim.Devices[0].ShareID = "share-1"
	if got := h.prepare(mpsClaim)["uid-mps"]; got.Err != nil || len(got.Devices[0].CDIDevices) != 2 {
		t.Fatalf("MPS claim on GPU 1: %+v", got)
	}
	got := h.prepare(claim("uid-mig", "mig", "gpu-2-mig-1g10gb-6"))["uid-mig"]
	if got.Err != nil {
		t.Fatalf("dynamic MIG claim on GPU 2 with MPS on: %v", got.Err)
	}
	uuid := findGPU(h, 2).ID
	h.step(HealthChanged{State: xidState(uuid, 79)})
	var tainted int
	for _, d := range rec.last().Devices {
		if d.Unhealthy != "" && d.ParentIndexOrSelf() == 2 {
			tainted++
		}
	}
	if tainted == 0 {
		t.Errorf("after XID 79 on GPU 2 no device of it is tainted: %v", poolNames(rec.last()))
	}
}

// The driver's MIG capability table unreadable: the spec still names every
// GPU, /status and the log say which MIG devices it lacks and why.
func TestCDISpecWithoutMIGCapabilities(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir)
	if err != nil {
		t.Fatal(err)
	}
	keeper := &cdi.Keeper{W: w, Caps: func() (cdi.CapMinors, error) {
		return cdi.ReadMigMinors(dir + "/no-such-mig-minors")
	}}
	h := newHarness(t, simNode(t, "dgx-h100-mig"), withMIG(), func(h *harness) { h.opts.CDI = keeper })
	h.config("version: v1\nconfigs:\n  default:\n    mig: {strategy: mixed}\n    devicePlugin:\n      deviceListStrategy: cdi-cri\n")
	names := specNames(t, dir)
	inv, _ := h.opts.Observer.Inventory()
	if !slices.Contains(names, inv.GPUs[0].UUID) || slices.Contains(names, inv.GPUs[0].Instances[0].UUID) {
		t.Errorf("spec names %v: want the GPUs, not the MIG devices", names)
	}
	if st := h.a.Status().CDI; st == nil || st.Spec == "" || !strings.Contains(st.Error, "no-such-mig-minors") {
		t.Errorf("/status cdi %+v, want the spec and an error naming the table", st)
	}
}
