package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// openStateNode builds an initialised node on a state file; Cleanup closes
// it, so a test may open the file again only after closing it itself.
func openStateNode(t *testing.T, profile, path string, opts ...Option) *Node {
	t.Helper()
	n, err := New(profile, append(opts, WithStateFile(path))...)
	if err != nil {
		t.Fatalf("New(%q) on %s: %v", profile, path, err)
	}
	n.Init()
	t.Cleanup(func() { n.Shutdown(); n.Close() })
	return n
}

func closeNode(t *testing.T, n *Node) {
	t.Helper()
	n.Shutdown()
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// observe renders, through NVML only, everything about the node's GPUs a
// state file keeps, so two nodes can be compared as an agent sees them.
func observe(t *testing.T, n *Node) string {
	t.Helper()
	var b strings.Builder
	count, _ := n.DeviceGetCount()
	for i := range count {
		d, r := n.DeviceGetHandleByIndex(i)
		if r != nvml.SUCCESS {
			fmt.Fprintf(&b, "gpu %d: %v\n", i, r)
			continue
		}
		u, _ := d.GetUUID()
		cur, pend, r := d.GetMigMode()
		fmt.Fprintf(&b, "gpu %d %s mig %d/%d %v\n", i, u, cur, pend, r)
		for _, e := range []nvml.MemoryErrorType{nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.MEMORY_ERROR_TYPE_UNCORRECTED} {
			for _, c := range []nvml.EccCounterType{nvml.VOLATILE_ECC, nvml.AGGREGATE_ECC} {
				v, _ := d.GetTotalEccErrors(e, c)
				fmt.Fprintf(&b, "  ecc %d/%d = %d\n", e, c, v)
			}
		}
		fv := []nvml.FieldValue{{FieldId: nvml.FI_DEV_GET_GPU_RECOVERY_ACTION}}
		d.GetFieldValues(fv)
		fmt.Fprintf(&b, "  recovery %v\n", fv[0].Value[:4])
		rc, ru, rp, rf, r := d.GetRemappedRows()
		fmt.Fprintf(&b, "  remapped %d %d %v %v %v\n", rc, ru, rp, rf, r)
		for p := range nvml.GPU_INSTANCE_PROFILE_COUNT {
			info, r := d.GetGpuInstanceProfileInfo(p)
			if r != nvml.SUCCESS {
				continue
			}
			gis, _ := d.GetGpuInstances(&info)
			for _, gi := range gis {
				gii, _ := gi.GetInfo()
				fmt.Fprintf(&b, "  gi %d profile %d at %d+%d\n", gii.Id, gii.ProfileId, gii.Placement.Start, gii.Placement.Size)
				for cp := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
					cinfo, r := gi.GetComputeInstanceProfileInfo(cp, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
					if r != nvml.SUCCESS {
						continue
					}
					cis, _ := gi.GetComputeInstances(&cinfo)
					for _, ci := range cis {
						cii, _ := ci.GetInfo()
						fmt.Fprintf(&b, "    ci %d profile %d at %d+%d\n", cii.Id, cii.ProfileId, cii.Placement.Start, cii.Placement.Size)
					}
				}
			}
		}
		for m := range maxMigDevices {
			md, r := d.GetMigDeviceHandleByIndex(m)
			if r != nvml.SUCCESS {
				break
			}
			u, _ := md.GetUUID()
			gid, _ := md.GetGpuInstanceId()
			cid, _ := md.GetComputeInstanceId()
			fmt.Fprintf(&b, "  mig device %d: gi %d ci %d %s\n", m, gid, cid, u)
		}
	}
	return b.String()
}

func TestStateSurvivesReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sim-state.json")
	n := openStateNode(t, "dgx-a100", path, WithMIGEnabled())

	// GPU 0: GIs 2 and 3 after GI 1 is gone, so a node rebuilt by
	// creating instances afresh would number them 1 and 2; CI 1 in GI 3
	// after CI 0 is gone; GI 2 without a compute instance.
	d := handle(t, n, 0)
	gi1 := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0)
	createGI(t, d, nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2)
	gi3 := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	wantRet(t, "destroy GI 1", gi1.Destroy(), nvml.SUCCESS)
	c1, r := gi3.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	wantRet(t, "1-slice CI profile", r, nvml.SUCCESS)
	ci0, r := gi3.CreateComputeInstance(&c1)
	wantRet(t, "create CI 0", r, nvml.SUCCESS)
	_, r = gi3.CreateComputeInstanceWithPlacement(&c1, &nvml.ComputeInstancePlacement{Start: 2, Size: 1})
	wantRet(t, "create CI 1 at 2", r, nvml.SUCCESS)
	wantRet(t, "destroy CI 0", ci0.Destroy(), nvml.SUCCESS)
	mig, r := d.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG device 0", r, nvml.SUCCESS)
	migUUID, _ := mig.GetUUID()

	// GPU 1: MIG off, pending until a reset.
	act, r := handle(t, n, 1).SetMigMode(nvml.DEVICE_MIG_DISABLE)
	wantRet(t, "SetMigMode", r, nvml.SUCCESS)
	wantRet(t, "activation", act, nvml.ERROR_RESET_REQUIRED)

	// GPU 2: counters; GPU 3: lost.
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(n.SetECC(2, 5, 1))
	must(n.InjectXID(2, 48)) // a double-bit error: one more uncorrected
	must(n.SetRecoveryAction(2, nvml.GPU_RECOVERY_ACTION_NODE_REBOOT))
	must(n.SetRemappedRows(2, 3, 1, true, false))
	must(n.SetLost(3, true))

	before := observe(t, n)
	closeNode(t, n)
	// No MIG option: what the file says wins over how a new node starts.
	n2 := openStateNode(t, "dgx-a100", path)
	after := observe(t, n2)
	if before != after {
		t.Fatalf("state differs after reload:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	// The comparison above passes on two empty nodes too; pin the facts.
	d2 := handle(t, n2, 0)
	for _, want := range []struct {
		id      int
		profile uint32
		start   uint32
		cis     int
	}{{2, 14, 2, 0}, {3, 9, 4, 1}} {
		gi, r := d2.GetGpuInstanceById(want.id)
		wantRet(t, fmt.Sprintf("GI %d after reload", want.id), r, nvml.SUCCESS)
		if r != nvml.SUCCESS {
			continue
		}
		info, _ := gi.GetInfo()
		if info.ProfileId != want.profile || info.Placement.Start != want.start {
			t.Errorf("GI %d: %+v, want profile %d at %d", want.id, info, want.profile, want.start)
		}
		if _, r := gi.GetComputeInstanceById(1); (r == nvml.SUCCESS) != (want.cis == 1) {
			t.Errorf("GI %d: CI 1 lookup %v, want %d compute instances", want.id, r, want.cis)
		}
	}
	if _, r := d2.GetGpuInstanceById(1); r != nvml.ERROR_NOT_FOUND {
		t.Errorf("destroyed GI 1 after reload: %v", r)
	}
	m2, r := d2.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG device after reload", r, nvml.SUCCESS)
	if u, _ := m2.GetUUID(); u != migUUID {
		t.Errorf("MIG uuid %s after reload, want %s", u, migUUID)
	}
	if h, r := n2.DeviceGetHandleByUUID(migUUID); r != nvml.SUCCESS || h == nil {
		t.Errorf("DeviceGetHandleByUUID(%s) after reload: %v", migUUID, r)
	}
	if c, p, _ := handle(t, n2, 1).GetMigMode(); c != nvml.DEVICE_MIG_ENABLE || p != nvml.DEVICE_MIG_DISABLE {
		t.Errorf("GPU 1 MIG mode %d/%d, want pending disable", c, p)
	}
	d2 = handle(t, n2, 2)
	if v, _ := d2.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC); v != 2 {
		t.Errorf("GPU 2 uncorrected ECC %d, want 2", v)
	}
	if _, r := n2.DeviceGetHandleByIndex(3); r != nvml.ERROR_GPU_IS_LOST {
		t.Errorf("GPU 3 after reload: %v, want lost", r)
	}

	// A reset is kept too: it clears what the hardware clears.
	if err := n2.Reset(2); err != nil {
		t.Fatal(err)
	}
	if err := n2.Reset(1); err != nil {
		t.Fatal(err)
	}
	closeNode(t, n2)
	n3 := openStateNode(t, "dgx-a100", path)
	if v, _ := handle(t, n3, 2).GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); v != 0 {
		t.Errorf("volatile ECC %d after reset and reload", v)
	}
	if c, _, _ := handle(t, n3, 1).GetMigMode(); c != nvml.DEVICE_MIG_DISABLE {
		t.Errorf("GPU 1 MIG mode %d after reset and reload, want disabled", c)
	}
}

// Crash-recovery tests elsewhere start from a GPU instance whose compute
// instance was never made (the agent died in between).
func TestStateKeepsGIWithoutCI(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "dgx-h100", path, WithMIGEnabled())
	createGI(t, handle(t, n, 5), nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0)
	closeNode(t, n)

	d := handle(t, openStateNode(t, "dgx-h100", path), 5)
	gi, r := d.GetGpuInstanceById(1)
	wantRet(t, "GI 1 after reload", r, nvml.SUCCESS)
	if r != nvml.SUCCESS {
		return
	}
	info := giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_4_SLICE)
	if gii, _ := gi.GetInfo(); gii.ProfileId != info.Id || gii.Placement.Start != 0 {
		t.Errorf("GI after reload %+v", gii)
	}
	if _, r := d.GetMigDeviceHandleByIndex(0); r != nvml.ERROR_NOT_FOUND {
		t.Errorf("MIG device of a GI without CI: %v", r)
	}
	// And the agent can finish the job.
	createFullCI(t, gi)
}

func TestStateNewFileFromProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "dgx-h100-mig", path)
	want := observe(t, n)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("New did not write the state file: %v", err)
	}
	var st stateFile
	if err := json.Unmarshal(data, &st); err != nil || st.Version != 1 || st.Profile != "dgx-h100-mig" ||
		len(st.GPUs) != 8 || len(st.GPUs[0].GPUInstances) != 7 {
		t.Fatalf("state file %s: %v\n%s", path, err, data)
	}
	closeNode(t, n)
	// Loaded, not rebuilt: the layout is there once, not twice.
	if got := observe(t, openStateNode(t, "dgx-h100-mig", path)); got != want {
		t.Errorf("profile layout differs after reload:\n%s\nwant:\n%s", got, want)
	}
}

// stateEdit changes one field of a valid state file's JSON.
type stateEdit func(st map[string]any)

func gpuRec(st map[string]any, i int) map[string]any {
	return st["gpus"].([]any)[i].(map[string]any)
}

func TestStateFileErrors(t *testing.T) {
	dir := t.TempDir()
	valid := filepath.Join(dir, "valid.json")
	n := openStateNode(t, "dgx-a100", valid, WithMIGEnabled())
	createFullCI(t, createGI(t, handle(t, n, 0), nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4))
	closeNode(t, n)
	good, err := os.ReadFile(valid)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(good, []byte(`"3g.20gb"`)) {
		t.Fatalf("the GPU instance is not in the state file:\n%s", good)
	}
	h100 := filepath.Join(dir, "h100.json")
	closeNode(t, openStateNode(t, "dgx-h100", h100))
	h100Data, _ := os.ReadFile(h100)

	edited := func(e stateEdit) []byte {
		var st map[string]any
		if err := json.Unmarshal(good, &st); err != nil {
			t.Fatal(err)
		}
		e(st)
		b, _ := json.Marshal(st)
		return b
	}
	gi0 := func(st map[string]any) map[string]any {
		return gpuRec(st, 0)["gpu_instances"].([]any)[0].(map[string]any)
	}
	tests := []struct {
		name string
		data []byte
		want string
	}{
		{"torn write", good[:len(good)/2], "corrupt"},
		{"empty", nil, "empty"},
		{"not JSON", []byte("MIG everywhere\n"), "corrupt"},
		{"trailing garbage", append(bytes.Clone(good), "}"...), "corrupt"},
		{"other profile", h100Data, `written for profile "dgx-h100", not "dgx-a100"`},
		{"newer version", edited(func(st map[string]any) { st["version"] = 2; st["new"] = true }), "version 2, this build reads version 1"},
		{"no version", edited(func(st map[string]any) { delete(st, "version") }), `no "version"`},
		{"unknown field", edited(func(st map[string]any) { gpuRec(st, 1)["turbo"] = true }), `unknown field "turbo"`},
		{"GPU missing", edited(func(st map[string]any) { st["gpus"] = st["gpus"].([]any)[1:] }), "7 GPUs, profile dgx-a100 has 8"},
		{"GPU uuid", edited(func(st map[string]any) { gpuRec(st, 4)["uuid"] = "GPU-x" }), `gpu 4: uuid "GPU-x"`},
		{"GI without MIG", edited(func(st map[string]any) { gpuRec(st, 0)["mig_current"] = false }), "gpu 0: gpu_instances with MIG mode off"},
		{"GI placement", edited(func(st map[string]any) { gi0(st)["placement"] = map[string]any{"start": 3, "size": 4} }),
			"gpu 0: gpu instance 1: placement 3+4 is not a 3g.20gb placement"},
		{"GI profile", edited(func(st map[string]any) { gi0(st)["profile_id"] = 2 }), "gpu instance 1: profile_id 2 is not one of"},
		{"GI profile name", edited(func(st map[string]any) { gi0(st)["profile"] = "7g.40gb" }), `profile "7g.40gb", but profile_id 9 is 3g.20gb`},
		{"GI ids", edited(func(st map[string]any) {
			g := gpuRec(st, 0)
			second := map[string]any{"id": 1, "profile_id": 9, "profile": "3g.20gb", "placement": map[string]any{"start": 0, "size": 4}}
			g["gpu_instances"] = append(g["gpu_instances"].([]any), second)
		}), "gpu instance 1: id used twice"},
		{"CI uuid", edited(func(st map[string]any) {
			gi0(st)["compute_instances"].([]any)[0].(map[string]any)["uuid"] = "MIG-x"
		}), `compute instance 0: uuid "MIG-x"`},
		{"CI too big", edited(func(st map[string]any) {
			gi0(st)["compute_instances"].([]any)[0].(map[string]any)["profile_id"] = nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE
		}), "compute instance 0: profile_id 4 does not fit a 3g.20gb instance"},
		{"negative remap", edited(func(st map[string]any) { gpuRec(st, 2)["remapped_rows"] = map[string]any{"corrected": -1} }), "gpu 2: negative remapped_rows"},
		// A valid file padded past the bound: refused unread, so that a path
		// naming something else cannot fill memory.
		{"too large", append(bytes.Repeat([]byte(" "), maxStateBytes), good...), "larger than 1048576 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.json")
			if err := os.WriteFile(path, tt.data, 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := New("dgx-a100", WithStateFile(path))
			if err == nil {
				t.Fatal("New succeeded")
			}
			if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q, want the path and %q", err, tt.want)
			}
			// Never reset "hardware" over a file the node could not read.
			if got, _ := os.ReadFile(path); !bytes.Equal(got, tt.data) {
				t.Errorf("New rewrote the file it refused")
			}
			// Nor keep it locked: fixing the file is enough to start.
			if err := os.WriteFile(path, good, 0o644); err != nil {
				t.Fatal(err)
			}
			n, err := New("dgx-a100", WithStateFile(path))
			if err != nil {
				t.Fatalf("New after fixing the file: %v", err)
			}
			n.Close()
		})
	}
}

// A state file of the largest size allowed, but all list items, is refused
// before it is decoded: encoding/json makes a record of every item (even
// after a type error), which cost over 200 MB for 1 MiB of "{},".
func TestStateLoadBoundsMemory(t *testing.T) {
	for _, shape := range []struct{ name, head, item, tail string }{
		{"GPUs", `{"version":1,"profile":"gh200","gpus":[{}`, ",{}", "]}"},
		{"numbers for GPU instances", `{"version":1,"profile":"gh200","gpus":[{"gpu_instances":[1`, ",1", "]}]}"},
	} {
		var b strings.Builder
		b.WriteString(shape.head)
		for b.Len()+len(shape.item)+len(shape.tail) <= maxStateBytes {
			b.WriteString(shape.item)
		}
		b.WriteString(shape.tail)
		data := []byte(b.String())
		n, err := New("gh200")
		if err != nil {
			t.Fatal(err)
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		err = n.load(data)
		runtime.ReadMemStats(&after)
		if err == nil || !strings.Contains(err.Error(), "refused undecoded") {
			t.Errorf("%s: load = %v, want it refused undecoded", shape.name, err)
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4<<20 {
			t.Errorf("%s: loading %d bytes allocated %d MB", shape.name, len(data), alloc>>20)
		}
	}
}

// An A30 has one optical flow accelerator, which each +me profile takes:
// NVML makes a 1g.6gb+me or a 2g.12gb+me, never both, and neither may a
// state file.
func TestStateRefusesSecondOFA(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "pcie-a30x4", path, WithMIGEnabled())
	d := handle(t, n, 0)
	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0))
	_, r := d.CreateGpuInstanceWithPlacement(giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1), &nvml.GpuInstancePlacement{Start: 2, Size: 2})
	wantRet(t, "second +me instance", r, nvml.ERROR_INSUFFICIENT_RESOURCES)
	createGI(t, d, nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2) // no compute instance: its UUID would name the profile
	closeNode(t, n)
	good, _ := os.ReadFile(path)
	from, to := `"profile_id": 5,
          "profile": "2g.12gb",`, `"profile_id": 6,
          "profile": "2g.12gb+me",`
	if !bytes.Contains(good, []byte(from)) {
		t.Fatalf("state file lacks %s:\n%s", from, good)
	}
	if err := os.WriteFile(path, bytes.Replace(good, []byte(from), []byte(to), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := New("pcie-a30x4", WithStateFile(path))
	if want := "gpu 0: gpu instance 2: 2g.12gb+me needs an optical flow accelerator"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("New: %v, want %q", err, want)
	}
}

func TestStateV100RefusesMIGAndRemap(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	closeNode(t, openStateNode(t, "dgx1-v100", path))
	good, _ := os.ReadFile(path)
	tests := []struct{ from, to, want string }{
		{`"mig_pending": false`, `"mig_pending": true`, "gpu 0: MIG mode on, but the Tesla V100-SXM2-32GB has no MIG"},
		{`"pending": false`, `"pending": true`, "gpu 0: remapped_rows set, but the Tesla V100-SXM2-32GB does not remap rows"},
		{`"recovery_action": 0`, `"recovery_action": 4`, ""}, // any action is one to keep
	}
	for _, tt := range tests {
		if !bytes.Contains(good, []byte(tt.from)) {
			t.Fatalf("state file lacks %s:\n%s", tt.from, good)
		}
		if err := os.WriteFile(path, bytes.Replace(good, []byte(tt.from), []byte(tt.to), 1), 0o644); err != nil {
			t.Fatal(err)
		}
		n, err := New("dgx1-v100", WithStateFile(path))
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s: %v", tt.to, err)
		case tt.want == "":
			n.Close()
		case err == nil || !strings.Contains(err.Error(), tt.want):
			t.Errorf("%s: error %v, want %q", tt.to, err, tt.want)
		}
	}
}

// When the file cannot be written, the call fails and nothing changes:
// otherwise the agent would believe in state a restart loses.
func TestStateWriteFailureChangesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "s.json")
	var logs bytes.Buffer
	n := openStateNode(t, "dgx-a100", path, WithMIGEnabled(), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	d := handle(t, n, 0)
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	ci := createFullCI(t, gi)
	if err := n.SetECC(1, 2, 0); err != nil {
		t.Fatal(err)
	}
	before := observe(t, n)

	if err := os.RemoveAll(dir); err != nil { // even root cannot write there now
		t.Fatal(err)
	}
	info := giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	_, r := d.CreateGpuInstance(info)
	wantRet(t, "CreateGpuInstance", r, nvml.ERROR_UNKNOWN)
	wantRet(t, "ComputeInstanceDestroy", ci.Destroy(), nvml.ERROR_UNKNOWN)
	cinfo, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	_, r = gi.CreateComputeInstance(&cinfo)
	wantRet(t, "CreateComputeInstance", r, nvml.ERROR_INSUFFICIENT_RESOURCES) // the full CI is still there
	_, r = handle(t, n, 1).SetMigMode(nvml.DEVICE_MIG_DISABLE)
	wantRet(t, "SetMigMode", r, nvml.ERROR_UNKNOWN)
	for name, err := range map[string]error{
		"SetECC":            n.SetECC(1, 9, 9),
		"SetLost":           n.SetLost(2, true),
		"Reset":             n.Reset(0),
		"InjectXID 48":      n.InjectXID(1, 48),
		"SetRecoveryAction": n.SetRecoveryAction(3, nvml.GPU_RECOVERY_ACTION_GPU_RESET),
	} {
		if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "sim gpu") {
			t.Errorf("%s: error %v, want one naming the GPU and %s", name, err, path)
		}
	}
	// Telemetry is not kept, so it needs no file.
	if err := n.SetTemperature(0, 60); err != nil {
		t.Errorf("SetTemperature: %v", err)
	}
	if after := observe(t, n); after != before {
		t.Errorf("failed calls changed the node:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if _, r := ci.GetInfo(); r != nvml.SUCCESS {
		t.Errorf("CI handle after failed Destroy: %v", r)
	}
	if !strings.Contains(logs.String(), "CreateGpuInstance") || !strings.Contains(logs.String(), path) {
		t.Errorf("log does not say which call failed and why:\n%s", logs.String())
	}

	// Once the directory is back, the same calls work and are kept.
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	wantRet(t, "ComputeInstanceDestroy", ci.Destroy(), nvml.SUCCESS)
	wantRet(t, "GpuInstanceDestroy", gi.Destroy(), nvml.SUCCESS)
	closeNode(t, n)
	n2 := openStateNode(t, "dgx-a100", path)
	if _, r := handle(t, n2, 0).GetGpuInstanceById(1); r != nvml.ERROR_NOT_FOUND {
		t.Errorf("destroyed GI after reload: %v", r)
	}
}

func TestStateOneProcessAtATime(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "pcie-4gpu", path)
	if _, err := New("pcie-4gpu", WithStateFile(path)); err == nil || !strings.Contains(err.Error(), "in use by process") {
		t.Fatalf("second node on %s: %v, want in use", path, err)
	}
	closeNode(t, n)
	// Closed, the node can no longer change what the file says.
	if err := n.SetLost(0, true); err == nil {
		t.Error("SetLost after Close succeeded")
	}
	n2 := openStateNode(t, "pcie-4gpu", path)
	if _, r := n2.DeviceGetHandleByIndex(0); r != nvml.SUCCESS {
		t.Errorf("GPU 0 after reopen: %v", r)
	}
}

// stateChildEnv makes the test binary the agent of TestStateSurvivesKill.
const stateChildEnv = "GPU_AGENT_SIM_STATE_CHILD"

// TestStateKillChild is the process TestStateSurvivesKill kills: it makes
// a MIG device, says so and waits for the kill.
func TestStateKillChild(t *testing.T) {
	path := os.Getenv(stateChildEnv)
	if path == "" {
		t.Skip("run by TestStateSurvivesKill")
	}
	n, err := New("dgx-a100", WithMIGEnabled(), WithStateFile(path))
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	n.Init()
	d, _ := n.DeviceGetHandleByIndex(6)
	info, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_2_SLICE)
	gi, r := d.CreateGpuInstance(&info)
	if r != nvml.SUCCESS {
		fmt.Println("error:", r)
		return
	}
	ci, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
		fmt.Println("error:", r)
		return
	}
	m, _ := d.GetMigDeviceHandleByIndex(0)
	u, _ := m.GetUUID()
	fmt.Println("created", u)
	os.Stdin.Read(make([]byte, 1)) // until killed: the parent never writes
}

// What an NVML call did before it returned is there for the next process,
// even when the one that made it is killed with no chance to clean up.
func TestStateSurvivesKill(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a child process")
	}
	path := filepath.Join(t.TempDir(), "s.json")
	cmd := exec.Command(os.Args[0], "-test.run=^TestStateKillChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), stateChildEnv+"="+path)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	cmd.Process.Kill() // SIGKILL
	cmd.Wait()
	uuid, ok := strings.CutPrefix(strings.TrimSpace(line), "created ")
	if err != nil || !ok {
		t.Fatalf("child said %q, %v", line, err)
	}

	n := openStateNode(t, "dgx-a100", path)
	m, r := n.DeviceGetHandleByUUID(uuid)
	wantRet(t, "MIG device the killed process made", r, nvml.SUCCESS)
	if r == nvml.SUCCESS {
		if gi, _ := m.GetGpuInstanceId(); gi != 1 {
			t.Errorf("GI id %d, want 1", gi)
		}
	}
}

// WithCrashAfter stops the process right after the nth change, with that
// change already in the state file.
func TestCrashAfterNthChange(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	crashed := 0
	n, err := New("dgx-a100", WithMIGEnabled(), WithStateFile(path), WithCrashAfter(2, func() { crashed++ }))
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	dev, _ := n.DeviceGetHandleByIndex(0)
	info, _ := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	gi, r := dev.CreateGpuInstance(&info)
	if r != nvml.SUCCESS || crashed != 0 {
		t.Fatalf("first change: %v, crashed %d times", r, crashed)
	}
	ciInfo, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if _, r := gi.CreateComputeInstance(&ciInfo); r != nvml.SUCCESS || crashed != 1 {
		t.Fatalf("second change: %v, crashed %d times, want once", r, crashed)
	}
	n.Close()
	again, err := New("dgx-a100", WithStateFile(path))
	if err != nil {
		t.Fatal(err)
	}
	again.Init()
	d, _ := again.DeviceGetHandleByIndex(0)
	if c, r := d.GetMaxMigDeviceCount(); r != nvml.SUCCESS || c == 0 {
		t.Fatal(r)
	}
	if _, r := d.GetMigDeviceHandleByIndex(0); r != nvml.SUCCESS {
		t.Errorf("the change before the crash is not in the state file: %v", r)
	}
}

// A copy made from a node's State looks the same through NVML, changes
// without touching the original or its state file, and needs no lock on
// the file the original holds (the offline tools copy the node a running
// agent uses).
func TestStateCopy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "dgx-a100", path, WithMIGEnabled())
	createGI(t, handle(t, n, 0), nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	if err := n.SetLost(3, true); err != nil {
		t.Fatal(err)
	}
	state, err := n.State()
	if err != nil {
		t.Fatal(err)
	}
	if p, err := StateProfile(state); err != nil || p != "dgx-a100" {
		t.Fatalf("StateProfile = %q, %v; want dgx-a100", p, err)
	}
	fileBefore, _ := os.ReadFile(path)

	c, err := New("dgx-a100", WithState(state))
	if err != nil {
		t.Fatalf("copy while the original holds %s: %v", path, err)
	}
	c.Init()
	defer c.Shutdown()
	if got, want := observe(t, c), observe(t, n); got != want {
		t.Fatalf("copy observes\n%s\noriginal\n%s", got, want)
	}
	createGI(t, handle(t, c, 0), nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0)
	if observe(t, c) == observe(t, n) {
		t.Error("a GPU instance made on the copy is not seen on it")
	}
	if fileAfter, _ := os.ReadFile(path); !bytes.Equal(fileBefore, fileAfter) {
		t.Error("a change to the copy rewrote the original's state file")
	}

	for _, tc := range []struct {
		name    string
		profile string
		opts    []Option
		want    string
	}{
		{"other profile", "dgx-h100", []Option{WithState(state)}, `written for profile "dgx-a100"`},
		{"not JSON", "dgx-a100", []Option{WithState([]byte("{"))}, "copied state: corrupt"},
		{"with a state file", "dgx-a100", []Option{WithState(state), WithStateFile(filepath.Join(t.TempDir(), "x"))}, "exclusive"},
	} {
		if _, err := New(tc.profile, tc.opts...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New = %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
	if _, err := StateProfile([]byte(`{"version":1}`)); err == nil || !strings.Contains(err.Error(), "profile") {
		t.Errorf("StateProfile without a profile: %v", err)
	}
}
