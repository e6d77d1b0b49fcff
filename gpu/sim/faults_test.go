package sim

import (
	"encoding/binary"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

func TestTelemetrySetters(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); defer mu.Unlock(); now = now.Add(d) }

	n := newNode(t, "dgx-a100", WithClock(clock))
	d := handle(t, n, 2)
	other := handle(t, n, 3)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(n.SetUtilization(2, 85, 40))
	must(n.SetMemoryUsed(2, 10<<30))
	must(n.SetTemperature(2, 71))
	must(n.SetClocks(2, 1410, 1215))
	must(n.SetECC(2, 5, 1))
	must(n.SetRemappedRows(2, 3, 1, true, false))
	must(n.SetProcesses(2, []nvml.ProcessInfo{{Pid: 100, UsedGpuMemory: 1 << 30, GpuInstanceId: NoInstance, ComputeInstanceId: NoInstance}}))

	if u, r := d.GetUtilizationRates(); r != nvml.SUCCESS || u != (nvml.Utilization{Gpu: 85, Memory: 40}) {
		t.Errorf("utilization %+v, %v", u, r)
	}
	if u, _ := other.GetUtilizationRates(); u != (nvml.Utilization{}) {
		t.Errorf("GPU 3 utilization changed: %+v", u)
	}
	// A100: the driver reserves what the full-size MIG instance (40192 MiB)
	// does not get; the first version of the call counts it as used.
	const reserved = (40960 - 40192) << 20
	if m, r := d.GetMemoryInfo(); r != nvml.SUCCESS || m.Used != 10<<30+reserved || m.Free != 40960<<20-10<<30-reserved {
		t.Errorf("memory %+v, %v", m, r)
	}
	if m, r := d.GetMemoryInfo_v2(); r != nvml.SUCCESS || m.Used != 10<<30 || m.Reserved != reserved || m.Free != 40960<<20-10<<30-reserved {
		t.Errorf("memory v2 %+v, %v", m, r)
	}
	if c, r := d.GetTemperature(nvml.TEMPERATURE_GPU); r != nvml.SUCCESS || c != 71 {
		t.Errorf("temperature %d, %v", c, r)
	}
	_, r := d.GetTemperature(nvml.TEMPERATURE_COUNT)
	wantRet(t, "temperature sensor out of range", r, nvml.ERROR_INVALID_ARGUMENT)
	if sm, _ := d.GetClockInfo(nvml.CLOCK_SM); sm != 1410 {
		t.Errorf("SM clock %d", sm)
	}
	if mem, _ := d.GetClockInfo(nvml.CLOCK_MEM); mem != 1215 {
		t.Errorf("memory clock %d", mem)
	}
	_, r = d.GetClockInfo(nvml.CLOCK_COUNT)
	wantRet(t, "clock type out of range", r, nvml.ERROR_INVALID_ARGUMENT)
	ecc := []struct {
		e    nvml.MemoryErrorType
		c    nvml.EccCounterType
		want uint64
	}{
		{nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC, 5},
		{nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.AGGREGATE_ECC, 5},
		{nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC, 1},
		{nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC, 1},
	}
	for _, e := range ecc {
		if got, r := d.GetTotalEccErrors(e.e, e.c); r != nvml.SUCCESS || got != e.want {
			t.Errorf("ECC %d/%d = %d, %v; want %d", e.e, e.c, got, r, e.want)
		}
		if got, _ := d.GetMemoryErrorCounter(e.e, e.c, nvml.MEMORY_LOCATION_DEVICE_MEMORY); got != e.want {
			t.Errorf("ECC in device memory %d/%d = %d; want %d", e.e, e.c, got, e.want)
		}
	}
	if c, u, p, f, r := d.GetRemappedRows(); r != nvml.SUCCESS || c != 3 || u != 1 || !p || f {
		t.Errorf("remapped rows %d %d %v %v %v", c, u, p, f, r)
	}
	if procs, r := d.GetComputeRunningProcesses(); r != nvml.SUCCESS || len(procs) != 1 || procs[0].Pid != 100 {
		t.Errorf("processes %v, %v", procs, r)
	}

	// Energy: idle power for 10 s, then 300 W for 2 s.
	e0, _ := d.GetTotalEnergyConsumption()
	advance(10 * time.Second)
	must(n.SetPower(2, 300_000))
	advance(2 * time.Second)
	e1, r := d.GetTotalEnergyConsumption()
	if want := e0 + uint64(a100.idlePowerMW)*10 + 300_000*2; r != nvml.SUCCESS || e1 != want {
		t.Errorf("energy %d mJ, want %d", e1, want)
	}
	if p, _ := d.GetPowerUsage(); p != 300_000 {
		t.Errorf("power %d mW", p)
	}

	// Reset clears volatile ECC but not aggregate, and ends the processes.
	must(n.Reset(2))
	if v, _ := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); v != 0 {
		t.Errorf("volatile ECC after reset %d", v)
	}
	if a, _ := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.AGGREGATE_ECC); a != 5 {
		t.Errorf("aggregate ECC after reset %d", a)
	}
	if procs, _ := d.GetComputeRunningProcesses(); len(procs) != 0 {
		t.Errorf("processes after reset %v", procs)
	}
}

func TestSetterErrors(t *testing.T) {
	n := newNode(t, "dgx1-v100")
	tests := []struct {
		name string
		err  error
	}{
		{"gpu out of range", n.SetTemperature(8, 50)},
		{"negative gpu", n.SetPower(-1, 1)},
		{"utilization above 100", n.SetUtilization(0, 101, 0)},
		{"memory above total", n.SetMemoryUsed(0, 33<<30)},
		{"clock above max", n.SetClocks(0, 5000, 877)},
		{"row remapping on Volta", n.SetRemappedRows(0, 1, 0, false, false)},
		{"xid out of range", n.InjectXID(9, 31)},
		{"lost out of range", n.SetLost(8, true)},
		{"reset out of range", n.Reset(8)},
		{"event of type 0", n.InjectEvent(Event{GPU: 0})},
	}
	for _, tt := range tests {
		if tt.err == nil {
			t.Errorf("%s: no error", tt.name)
		}
	}
	_, _, _, _, r := handle(t, n, 0).GetRemappedRows()
	wantRet(t, "V100 GetRemappedRows", r, nvml.ERROR_NOT_SUPPORTED)
}

func TestUtilizationNotSupportedWithMIG(t *testing.T) {
	n := newNode(t, "dgx-h100", WithMIGEnabled())
	_, r := handle(t, n, 0).GetUtilizationRates()
	wantRet(t, "utilization of a MIG-enabled GPU", r, nvml.ERROR_NOT_SUPPORTED)
}

func TestLostGPU(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 4)
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0)
	ci := createFullCI(t, gi)
	mig, _ := d.GetMigDeviceHandleByIndex(0)
	uuid, _ := d.GetUUID()
	if err := n.SetLost(4, true); err != nil {
		t.Fatal(err)
	}
	calls := map[string]func() nvml.Return{
		"GetName":            func() nvml.Return { _, r := d.GetName(); return r },
		"GetUUID":            func() nvml.Return { _, r := d.GetUUID(); return r },
		"GetMemoryInfo":      func() nvml.Return { _, r := d.GetMemoryInfo(); return r },
		"GetMigMode":         func() nvml.Return { _, _, r := d.GetMigMode(); return r },
		"GetNvLinkState":     func() nvml.Return { _, r := d.GetNvLinkState(0); return r },
		"GetFanSpeed (mock)": func() nvml.Return { _, r := d.GetFanSpeed(); return r },
		"RegisterEvents": func() nvml.Return {
			s, _ := n.EventSetCreate()
			return d.RegisterEvents(nvml.EventTypeXidCriticalError, s)
		},
		"MIG GetUUID":         func() nvml.Return { _, r := mig.GetUUID(); return r },
		"MIG GetMemoryInfo":   func() nvml.Return { _, r := mig.GetMemoryInfo(); return r },
		"GI GetInfo":          func() nvml.Return { _, r := gi.GetInfo(); return r },
		"GI Destroy":          gi.Destroy,
		"CI GetInfo":          func() nvml.Return { _, r := ci.GetInfo(); return r },
		"handle by index":     func() nvml.Return { _, r := n.DeviceGetHandleByIndex(4); return r },
		"handle by uuid":      func() nvml.Return { _, r := n.DeviceGetHandleByUUID(uuid); return r },
		"ancestor from peer":  func() nvml.Return { _, r := handle(t, n, 5).GetTopologyCommonAncestor(d); return r },
		"GetVbiosVersion(mk)": func() nvml.Return { _, r := mig.GetVbiosVersion(); return r },
	}
	for name, call := range calls {
		wantRet(t, name, call(), nvml.ERROR_GPU_IS_LOST)
	}
	if _, r := handle(t, n, 5).GetName(); r != nvml.SUCCESS {
		t.Errorf("other GPU affected: %v", r)
	}
	if count, _ := n.DeviceGetCount(); count != 8 {
		t.Errorf("count with a lost GPU %d, want 8", count)
	}
	if err := n.Reset(4); err != nil {
		t.Fatal(err)
	}
	if _, r := d.GetName(); r != nvml.SUCCESS {
		t.Errorf("after reset: %v", r)
	}
	n.SetLost(4, true)
	n.SetLost(4, false)
	if _, r := d.GetName(); r != nvml.SUCCESS {
		t.Errorf("after SetLost(false): %v", r)
	}
}

func registered(t *testing.T, n *Node, types uint64, gpus ...int) nvml.EventSet {
	t.Helper()
	s, r := n.EventSetCreate()
	wantRet(t, "EventSetCreate", r, nvml.SUCCESS)
	t.Cleanup(func() { s.Free() })
	for _, g := range gpus {
		wantRet(t, "RegisterEvents", handle(t, n, g).RegisterEvents(types, s), nvml.SUCCESS)
	}
	return s
}

func TestXIDEventRoundTrip(t *testing.T) {
	n := newNode(t, "dgx-a100")
	s := registered(t, n, nvml.EventTypeXidCriticalError|nvml.EventTypeDoubleBitEccError, 1, 2)

	start := time.Now()
	_, r := s.Wait(30)
	wantRet(t, "Wait with nothing queued", r, nvml.ERROR_TIMEOUT)
	if el := time.Since(start); el < 25*time.Millisecond {
		t.Errorf("Wait returned after %v, before its 30 ms timeout", el)
	}

	// Neither of these two reaches the set: GPU 0 is not registered, and
	// GPU 1 is not registered for PState events.
	n.InjectXID(0, 31)
	n.InjectEvent(Event{GPU: 1, Type: nvml.EventTypePState, GI: NoInstance, CI: NoInstance})
	n.InjectXID(2, 48)
	n.InjectEvent(Event{GPU: 1, Type: nvml.EventTypeXidCriticalError, Data: 94, GI: 3, CI: 0})
	want := []nvml.EventData{
		{Device: handle(t, n, 2), EventType: nvml.EventTypeXidCriticalError, EventData: 48, GpuInstanceId: NoInstance, ComputeInstanceId: NoInstance},
		{Device: handle(t, n, 1), EventType: nvml.EventTypeXidCriticalError, EventData: 94, GpuInstanceId: 3, ComputeInstanceId: 0},
	}
	for i, w := range want {
		e, r := n.EventSetWait(s, 1000)
		if r != nvml.SUCCESS || e != w {
			t.Errorf("event %d: %+v, %v; want %+v", i, e, r, w)
		}
	}
	_, r = s.Wait(0)
	wantRet(t, "queue drained", r, nvml.ERROR_TIMEOUT)

	// A waiter blocked in Wait is woken by an injected event.
	got := make(chan nvml.EventData, 1)
	go func() { e, _ := s.Wait(5000); got <- e }()
	testwait.For(t, "Wait blocked", func() bool { return s.(*eventSet).blockedWaits() == 1 })
	n.InjectXID(1, 13)
	select {
	case e := <-got:
		if e.EventData != 13 {
			t.Errorf("woken with %+v", e)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("blocked Wait not woken by InjectXID")
	}

	// Losing a GPU raises XID 79.
	n.SetLost(2, true)
	if e, r := s.Wait(1000); r != nvml.SUCCESS || e.EventData != 79 || e.Device != want[0].Device {
		t.Errorf("on lost GPU: %+v, %v", e, r)
	}
}

func TestEventSetRules(t *testing.T) {
	n := newNode(t, "dgx-h100", WithMIGEnabled())
	d := handle(t, n, 0)
	s, _ := n.EventSetCreate()
	wantRet(t, "register unsupported type", d.RegisterEvents(nvml.EventTypeXidCriticalError|nvml.EventTypeGpuRecoveryAction, s), nvml.ERROR_NOT_SUPPORTED)
	n.InjectXID(0, 31)
	_, r := s.Wait(0)
	wantRet(t, "nothing registered by the refused call", r, nvml.ERROR_TIMEOUT)
	supported, _ := d.GetSupportedEventTypes()
	wantRet(t, "register the supported mask", d.RegisterEvents(supported, s), nvml.SUCCESS)

	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0))
	mig, _ := d.GetMigDeviceHandleByIndex(0)
	wantRet(t, "register on a MIG device", mig.RegisterEvents(nvml.EventTypeXidCriticalError, s), nvml.ERROR_NOT_SUPPORTED)

	other := newNode(t, "dgx-h100")
	foreign, _ := other.EventSetCreate()
	wantRet(t, "register with another node's set", d.RegisterEvents(nvml.EventTypeXidCriticalError, foreign), nvml.ERROR_INVALID_ARGUMENT)

	// Free wakes a blocked Wait, and the set is unusable afterwards.
	done := make(chan nvml.Return, 1)
	go func() { _, r := s.Wait(10_000); done <- r }()
	testwait.For(t, "Wait blocked", func() bool { return s.(*eventSet).blockedWaits() == 1 })
	wantRet(t, "Free", n.EventSetFree(s), nvml.SUCCESS)
	select {
	case r := <-done:
		wantRet(t, "Wait on a freed set", r, nvml.ERROR_INVALID_ARGUMENT)
	case <-time.After(3 * time.Second):
		t.Fatal("Free did not wake Wait")
	}
	wantRet(t, "Free twice", s.Free(), nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "register on a freed set", d.RegisterEvents(nvml.EventTypeXidCriticalError, s), nvml.ERROR_INVALID_ARGUMENT)
}

func TestEventQueueBounded(t *testing.T) {
	n := newNode(t, "pcie-4gpu")
	s := registered(t, n, nvml.EventTypeXidCriticalError, 0)
	for i := range maxQueuedEvents + 10 {
		n.InjectXID(0, uint64(i))
	}
	e, _ := s.Wait(0)
	if e.EventData != 10 {
		t.Errorf("oldest kept event %d, want 10", e.EventData)
	}
}

// Run with -race: readers, MIG changes and injection at once.
func TestConcurrentUse(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	s := registered(t, n, nvml.EventTypeXidCriticalError, 0, 1, 2, 3)
	peer := handle(t, n, 7)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(3)
		go func() {
			defer wg.Done()
			d, _ := n.DeviceGetHandleByIndex(g)
			for range 200 {
				d.GetMemoryInfo()
				d.GetTotalEnergyConsumption()
				d.GetTopologyCommonAncestor(peer)
				d.GetMigDeviceHandleByIndex(0)
			}
		}()
		go func() {
			defer wg.Done()
			d, _ := n.DeviceGetHandleByIndex(g)
			info, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
			for range 100 {
				gi, r := d.CreateGpuInstance(&info)
				if r == nvml.SUCCESS {
					gi.Destroy()
				}
			}
		}()
		go func() {
			defer wg.Done()
			for i := range 100 {
				n.InjectXID(g, uint64(i))
				n.SetUtilization(g, uint32(i%100), 0)
				n.SetPower(g, uint32(i*1000))
			}
		}()
	}
	drained := make(chan int)
	go func() {
		count := 0
		for {
			if _, r := s.Wait(500); r != nvml.SUCCESS {
				drained <- count
				return
			}
			count++
		}
	}()
	wg.Wait()
	if got := <-drained; got != 400 {
		t.Errorf("drained %d events, want 400", got)
	}
}

func TestRecoveryActionAndDBE(t *testing.T) {
	n := newNode(t, "dgx-h100")
	d := handle(t, n, 3)
	action := func() uint32 {
		t.Helper()
		fv := []nvml.FieldValue{{FieldId: nvml.FI_DEV_GET_GPU_RECOVERY_ACTION}, {FieldId: nvml.FI_DEV_ECC_CURRENT}}
		if r := d.GetFieldValues(fv); r != nvml.SUCCESS {
			t.Fatalf("GetFieldValues: %v", r)
		}
		if nvml.Return(fv[1].NvmlReturn) != nvml.ERROR_NOT_SUPPORTED {
			t.Errorf("unmodelled field: %v, want NOT_SUPPORTED", nvml.Return(fv[1].NvmlReturn))
		}
		return binary.NativeEndian.Uint32(fv[0].Value[:4])
	}
	if got := action(); got != uint32(nvml.GPU_RECOVERY_ACTION_NONE) {
		t.Fatalf("initial recovery action %d", got)
	}
	if err := n.SetRecoveryAction(3, nvml.GPU_RECOVERY_ACTION_GPU_RESET); err != nil {
		t.Fatal(err)
	}
	if err := n.InjectXID(3, 48); err != nil {
		t.Fatal(err)
	}
	if got := action(); got != uint32(nvml.GPU_RECOVERY_ACTION_GPU_RESET) {
		t.Errorf("recovery action %d, want GPU_RESET", got)
	}
	if dbe, _ := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); dbe != 1 {
		t.Errorf("volatile DBE after XID 48: %d, want 1", dbe)
	}
	if err := n.Reset(3); err != nil {
		t.Fatal(err)
	}
	if got := action(); got != uint32(nvml.GPU_RECOVERY_ACTION_NONE) {
		t.Errorf("recovery action after reset %d, want NONE", got)
	}
	if dbe, _ := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); dbe != 0 {
		t.Errorf("volatile DBE after reset: %d", dbe)
	}
	if agg, _ := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC); agg != 1 {
		t.Errorf("aggregate DBE after reset: %d, want 1 (survives resets)", agg)
	}
}

// A reboot does to every GPU what a reset does, loads the driver afresh
// (injected failures end) and starts a new boot; what real GPUs keep across
// a reboot stays, in the state file too.
func TestReboot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	n := newNode(t, "dgx-a100", WithStateFile(path))
	boot := n.BootID()
	if boot == "" {
		t.Fatal("no boot id")
	}
	// GPU 0: MIG mode asked for, pending the reset real A100s need.
	wantRet(t, "SetMigMode", func() nvml.Return { _, r := handle(t, n, 0).SetMigMode(nvml.DEVICE_MIG_ENABLE); return r }(), nvml.SUCCESS)
	// GPU 1: MIG on with an instance.
	must(t, n.Reset(0))
	wantRet(t, "SetMigMode", func() nvml.Return { _, r := handle(t, n, 1).SetMigMode(nvml.DEVICE_MIG_ENABLE); return r }(), nvml.SUCCESS)
	must(t, n.Reset(1))
	createFullCI(t, createGI(t, handle(t, n, 1), nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0))
	// GPU 2 asks for MIG again, pending; GPU 3 is lost; GPU 4 had a
	// double-bit error and wants a reset; GPU 5's rows wait for one, GPU
	// 6's remapping failed; GPU 7 fails every GetName.
	wantRet(t, "SetMigMode", func() nvml.Return { _, r := handle(t, n, 2).SetMigMode(nvml.DEVICE_MIG_ENABLE); return r }(), nvml.SUCCESS)
	must(t, n.SetLost(3, true))
	must(t, n.InjectXID(4, 48))
	must(t, n.SetRecoveryAction(4, nvml.GPU_RECOVERY_ACTION_GPU_RESET))
	must(t, n.SetRemappedRows(5, 0, 2, true, false))
	must(t, n.SetRemappedRows(6, 0, 3, false, true))
	must(t, n.FailCalls(7, "GetName", nvml.ERROR_UNKNOWN, -1))

	must(t, n.Reboot())
	if n.BootID() == boot || n.BootID() == "" {
		t.Errorf("boot id %q after reboot, was %q: want a new one", n.BootID(), boot)
	}
	if cur, _, _ := handle(t, n, 1).GetMigMode(); cur != nvml.DEVICE_MIG_ENABLE {
		t.Errorf("gpu 1 MIG mode %d after reboot: MIG mode survives reboots", cur)
	}
	if gis, _ := handle(t, n, 1).GetGpuInstances(&nvml.GpuInstanceProfileInfo{Id: nvml.GPU_INSTANCE_PROFILE_3_SLICE}); len(gis) != 0 {
		t.Errorf("gpu 1 has %d GPU instances after reboot; they do not survive one", len(gis))
	}
	if cur, pend, _ := handle(t, n, 2).GetMigMode(); cur != nvml.DEVICE_MIG_ENABLE || pend != nvml.DEVICE_MIG_ENABLE {
		t.Errorf("gpu 2 MIG mode %d/%d after reboot: the pending mode applies", cur, pend)
	}
	if _, r := handle(t, n, 3).GetName(); r != nvml.SUCCESS {
		t.Errorf("lost gpu 3 after reboot: %v", r)
	}
	if dbe, _ := handle(t, n, 4).GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); dbe != 0 {
		t.Errorf("gpu 4 volatile DBE %d after reboot", dbe)
	}
	if agg, _ := handle(t, n, 4).GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC); agg != 1 {
		t.Errorf("gpu 4 aggregate DBE %d after reboot, want 1", agg)
	}
	if _, unc, pending, failure, _ := handle(t, n, 5).GetRemappedRows(); unc != 2 || pending || failure {
		t.Errorf("gpu 5 remapped rows %d pending %v failure %v: want 2 remapped, no longer pending", unc, pending, failure)
	}
	if _, _, _, failure, _ := handle(t, n, 6).GetRemappedRows(); !failure {
		t.Error("gpu 6: a failed remapping survives a reboot")
	}
	if _, r := handle(t, n, 7).GetName(); r != nvml.SUCCESS {
		t.Errorf("gpu 7 GetName after reboot: %v, want the injected failure gone", r)
	}

	// The state file has the new boot: a restarted process is in it.
	rebooted := n.BootID()
	must(t, n.Close())
	again := newNode(t, "dgx-a100", WithStateFile(path))
	if again.BootID() != rebooted {
		t.Errorf("boot id %q from the state file, want %q", again.BootID(), rebooted)
	}
	// Without a state file every node is a new boot, as its GPUs are new.
	if a, b := newNode(t, "pcie-4gpu"), newNode(t, "pcie-4gpu"); a.BootID() == b.BootID() {
		t.Error("two nodes without a state file share a boot id")
	}
}
