package imex

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	specs "tags.cncf.io/container-device-interface/specs-go"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// simTray is a GB200 tray in clique 7 with its driver files under a
// temporary root holding `channels` IMEX channels.
func simTray(t *testing.T, channels int) (*sim.Node, string) {
	t.Helper()
	n, err := sim.New("gb200-tray", sim.WithClique(7), sim.WithIMEXChannels(channels))
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	root := t.TempDir()
	// Without CAP_MKNOD the channel nodes are left out; the proc files,
	// which the driver reads, are written all the same.
	if err := n.WriteDriverFiles(root); err != nil && !strings.Contains(err.Error(), "CAP_MKNOD") {
		t.Fatal(err)
	}
	return n, root
}

func inventoryOf(t *testing.T, n *sim.Node) *gpu.Inventory {
	t.Helper()
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return inv
}

// fakeDomains serves ComputeDomains from a map.
type fakeDomains struct {
	mu sync.Mutex
	m  map[string]*cdv1.ComputeDomain
}

func (f *fakeDomains) Domain(uid string) (*cdv1.ComputeDomain, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cd, ok := f.m[uid]
	return cd, ok
}

func (f *fakeDomains) Listing(node string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for uid, cd := range f.m {
		if slices.ContainsFunc(cd.Status.Nodes, func(n cdv1.ComputeDomainNode) bool { return n.Name == node }) {
			out = append(out, uid)
		}
	}
	return out
}

func (f *fakeDomains) put(cd *cdv1.ComputeDomain) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.m == nil {
		f.m = map[string]*cdv1.ComputeDomain{}
	}
	f.m[string(cd.UID)] = cd
}

// fakeDaemons records the daemons wanted; ready says which are ready.
type fakeDaemons struct {
	mu    sync.Mutex
	want  []DaemonSpec
	ready map[string]bool
}

func (f *fakeDaemons) Set(s []DaemonSpec) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.want = slices.Clone(s)
}

func (f *fakeDaemons) State(d string) DaemonState {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ready[d] {
		return DaemonState{Ready: true, PID: 1}
	}
	return DaemonState{Reason: "UNAVAILABLE"}
}

func (f *fakeDaemons) wanted() []DaemonSpec {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.want)
}

func (f *fakeDaemons) setReady(d string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ready == nil {
		f.ready = map[string]bool{}
	}
	f.ready[d] = true
}

var clique7 = sim.ClusterUUID(7).String() + ".7"

func domain(uid, ns, name string, nodes ...cdv1.ComputeDomainNode) *cdv1.ComputeDomain {
	return &cdv1.ComputeDomain{ObjectMeta: metav1.ObjectMeta{UID: types.UID(uid), Namespace: ns, Name: name},
		Status: cdv1.ComputeDomainStatus{Nodes: nodes}}
}

func channelClaim(uid, ns, node, device, domainID string, mode cdv1.AllocationMode) *resourceapi.ResourceClaim {
	cfg := map[string]any{"apiVersion": cdv1.APIVersion, "kind": cdv1.KindComputeDomainChannelConfig, "domainID": domainID}
	if mode != "" {
		cfg["allocationMode"] = mode
	}
	return claimWith(uid, ns, node, device, "channel", cfg)
}

func claimWith(uid, ns, node, device, request string, cfg map[string]any) *resourceapi.ResourceClaim {
	raw, _ := json.Marshal(cfg)
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{UID: types.UID(uid), Namespace: ns, Name: "claim-" + uid},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: request, Driver: DriverName, Pool: node, Device: device}},
			Config: []resourceapi.DeviceAllocationConfiguration{{Source: resourceapi.AllocationConfigSourceClaim,
				DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
					Driver: DriverName, Parameters: runtime.RawExtension{Raw: raw}}}}},
		}}},
	}
}

type testDriver struct {
	*Driver
	domains *fakeDomains
	daemons *fakeDaemons
	cdiDir  string
}

func newTestDriver(t *testing.T, root, stateDir, cdiDir string, inv *gpu.Inventory, client *fake.Clientset, domains *fakeDomains) testDriver {
	t.Helper()
	w, err := cdi.NewWriter(cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	daemons := &fakeDaemons{}
	d, err := New(Options{NodeName: "node-a", Client: client, Domains: domains, Daemons: daemons, StateDir: stateDir, CDI: w, HostRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	d.SetInventory(inv)
	return testDriver{Driver: d, domains: domains, daemons: daemons, cdiDir: cdiDir}
}

func prepare(t *testing.T, d *Driver, c *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	t.Helper()
	got, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	return got[c.UID]
}

func readSpec(t *testing.T, dir, uid string) *specs.Spec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, cdi.IMEXSpecName(uid)+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// A channel claim of a ComputeDomain: Prepare records it with the domain's
// own channel and asks for the domain's daemon with the node list the
// controller wrote, answers "waiting" until that daemon is ready, then
// names the claim's CDI device, whose spec holds the channel's node with
// the major of /proc/devices. A restarted driver keeps the claim; Unprepare
// removes the spec; the daemon stops once the node's entry goes.
func TestPrepareChannelClaim(t *testing.T) {
	n, root := simTray(t, 16)
	state, cdiDir := t.TempDir(), t.TempDir()
	domains := &fakeDomains{}
	domains.put(domain("cd-1", "team", "job",
		cdv1.ComputeDomainNode{Name: "node-b", IPAddress: "10.0.0.2", CliqueID: clique7, Index: 1},
		cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7, Index: 0},
		cdv1.ComputeDomainNode{Name: "node-c", IPAddress: "10.0.1.1", CliqueID: "other.1", Index: 0}))
	td := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)

	claim := channelClaim("uid-1", "team", "node-a", "channel-0", "cd-1", "")
	res := prepare(t, td.Driver, claim)
	if res.Err == nil || !strings.Contains(res.Err.Error(), "waiting for the IMEX daemon of ComputeDomain team/job") {
		t.Fatalf("first Prepare: %+v, want waiting for the daemon", res)
	}
	want := td.daemons.wanted()
	if len(want) != 1 || want[0].Domain != "cd-1" || want[0].BindIP != "10.0.0.1" || !slices.Equal(want[0].Nodes, []string{"10.0.0.1", "10.0.0.2"}) {
		t.Fatalf("daemons wanted %+v: want cd-1's, with its clique's nodes by index", want)
	}
	td.daemons.setReady("cd-1")
	res = prepare(t, td.Driver, claim)
	if res.Err != nil || len(res.Devices) != 1 || res.Devices[0].DeviceName != "channel-0" ||
		!slices.Equal(res.Devices[0].CDIDeviceIDs, []string{cdi.IMEXDeviceName("uid-1")}) {
		t.Fatalf("Prepare once ready: %+v", res)
	}
	st := td.Status()
	if len(st.Claims) != 1 || len(st.Claims[0].Channels) != 1 {
		t.Fatalf("status claims %+v", st.Claims)
	}
	ch := st.Claims[0].Channels[0]
	if ch == 0 || ch != preferredChannel("cd-1", 16) {
		t.Errorf("channel %d, want the domain's own %d (never NVIDIA's shared 0)", ch, preferredChannel("cd-1", 16))
	}
	if server, _ := serverPorts(ch); want[0].ServerPort != server {
		t.Errorf("daemon port %d, want %d from the domain's channel", want[0].ServerPort, server)
	}
	spec := readSpec(t, cdiDir, "uid-1")
	nodes := spec.Devices[0].ContainerEdits.DeviceNodes
	wantPath := ChannelDir + "/channel" + itoa(ch)
	if spec.Kind != cdi.IMEXKind || len(nodes) != 1 || nodes[0].Path != wantPath || nodes[0].Major != 234 || nodes[0].Minor != int64(ch) || nodes[0].Type != "c" {
		t.Fatalf("CDI spec %+v: want %s, major 234, minor %d", spec, wantPath, ch)
	}

	// A restart: the claim comes back from the checkpoint, with its channel.
	td2 := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
	td2.daemons.setReady("cd-1")
	if st := td2.Status(); len(st.Claims) != 1 || st.Claims[0].Channels[0] != ch {
		t.Fatalf("after restart: %+v", st.Claims)
	}
	if w := td2.daemons.wanted(); len(w) != 1 || w[0].Domain != "cd-1" {
		t.Errorf("after restart the daemons wanted are %+v", w)
	}
	if res := prepare(t, td2.Driver, claim); res.Err != nil || len(res.Devices) != 1 {
		t.Fatalf("Prepare after restart: %+v", res)
	}
	un, err := td2.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "uid-1"}})
	if err != nil || un["uid-1"] != nil {
		t.Fatalf("Unprepare: %v %v", un, err)
	}
	if _, err := os.Stat(filepath.Join(cdiDir, cdi.IMEXSpecName("uid-1")+".json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("spec left after Unprepare: %v", err)
	}
	// The daemon follows the controller's entry, not the claims: the
	// controller removes the entry once the workload's claims leave the
	// node, and only then does the daemon stop.
	if w := td2.daemons.wanted(); len(w) != 1 {
		t.Errorf("daemons wanted after the last claim went, the node still listed: %+v, want cd-1's", w)
	}
	domains.put(domain("cd-1", "team", "job",
		cdv1.ComputeDomainNode{Name: "node-b", IPAddress: "10.0.0.2", CliqueID: clique7, Index: 1}))
	td2.Refresh(context.Background())
	if w := td2.daemons.wanted(); len(w) != 0 {
		t.Errorf("daemons still wanted after the node's entry went: %+v", w)
	}
	td3 := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
	if st := td3.Status(); len(st.Claims) != 0 {
		t.Errorf("an unprepared claim came back after a restart: %+v", st.Claims)
	}
}

func itoa(i int) string { b, _ := json.Marshal(i); return string(b) }

// Channel isolation (NVIDIA's #892): two domains on one node, both
// allocated channel-0 by NVIDIA's default class, get channels of their
// own; a second claim of one domain shares its channel; All is refused
// while another domain holds a channel; a claim of another namespace than
// its domain's is refused.
func TestChannelIsolation(t *testing.T) {
	n, root := simTray(t, 8)
	domains := &fakeDomains{}
	for _, id := range []string{"cd-1", "cd-2", "cd-3"} {
		domains.put(domain(id, "team", id, cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7}))
	}
	td := newTestDriver(t, root, t.TempDir(), t.TempDir(), inventoryOf(t, n), fake.NewClientset(), domains)
	for _, id := range []string{"cd-1", "cd-2", "cd-3"} {
		td.daemons.setReady(id)
	}
	for _, c := range []*resourceapi.ResourceClaim{
		channelClaim("a", "team", "node-a", "channel-0", "cd-1", ""),
		channelClaim("b", "team", "node-a", "channel-0", "cd-2", ""),
		channelClaim("c", "team", "node-a", "channel-0", "cd-1", ""),
	} {
		if res := prepare(t, td.Driver, c); res.Err != nil {
			t.Fatalf("claim %s: %v", c.UID, res.Err)
		}
	}
	got := map[types.UID][]int{}
	for _, c := range td.Status().Claims {
		got[c.UID] = c.Channels
	}
	if got["a"][0] == got["b"][0] || got["a"][0] != got["c"][0] || got["a"][0] == 0 || got["b"][0] == 0 {
		t.Errorf("channels %v: want cd-1's a and c to share one, cd-2's b another, neither 0", got)
	}
	if res := prepare(t, td.Driver, channelClaim("d", "team", "node-a", "channel-0", "cd-3", cdv1.AllocationModeAll)); res.Err == nil {
		t.Error("allocation mode All given while other domains hold channels")
	}
	if res := prepare(t, td.Driver, channelClaim("e", "elsewhere", "node-a", "channel-0", "cd-3", "")); res.Err == nil || !strings.Contains(res.Err.Error(), "namespace") {
		t.Errorf("claim of another namespace than its domain: %v", res.Err)
	}
	if res := prepare(t, td.Driver, claimWith("f", "team", "node-a", "channel-0", "channel", map[string]any{"apiVersion": cdv1.APIVersion, "kind": "GpuConfig"})); res.Err == nil {
		t.Error("a channel claim without a compute-domain config was prepared")
	}
	// The daemon claim gets the domain's identity in its environment.
	dc := claimWith("g", "driver-ns", "node-a", DaemonDevice, "daemon", map[string]any{"apiVersion": cdv1.APIVersion, "kind": cdv1.KindComputeDomainDaemonConfig, "domainID": "cd-2"})
	if res := prepare(t, td.Driver, dc); res.Err != nil || len(res.Devices) != 1 {
		t.Fatalf("daemon claim: %+v", res)
	}
	env := readSpec(t, td.cdiDir, "g").Devices[0].ContainerEdits.Env
	for _, e := range []string{"COMPUTE_DOMAIN_UUID=cd-2", "COMPUTE_DOMAIN_NAME=cd-2", "COMPUTE_DOMAIN_NAMESPACE=team", "CLIQUE_ID=" + clique7} {
		if !slices.Contains(env, e) {
			t.Errorf("daemon claim env %v lacks %s", env, e)
		}
	}
}

// The pool: channels counted from the driver's params, the daemon device,
// NVIDIA's attributes, at most 64 devices a slice; fabric faults injected
// in the sim taint the channels (NoExecute for a broken route, NoSchedule
// for degraded bandwidth), and refuse new channel claims while broken.
func TestPoolAndFabricTaints(t *testing.T) {
	n, root := simTray(t, 130)
	host, err := ReadHost(root)
	if err != nil || host.Channels != 130 || host.Major != 234 {
		t.Fatalf("ReadHost: %+v %v", host, err)
	}
	inv := inventoryOf(t, n)
	f := FabricOf(inv)
	if !f.Attached || f.Clique != clique7 || len(f.Faults) != 0 {
		t.Fatalf("fabric %+v", f)
	}
	res := Resources("node-a", Pool{Channels: host.Channels, Faults: f.Faults}, 1, Dropped{})
	pool := res.Pools["node-a"]
	var devs []resourceapi.Device
	for _, s := range pool.Slices {
		if len(s.Devices) > resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures {
			t.Errorf("slice of %d devices", len(s.Devices))
		}
		devs = append(devs, s.Devices...)
	}
	if len(devs) != 131 || devs[0].Name != DaemonDevice || *devs[0].Attributes[AttrType].StringValue != TypeDaemon ||
		devs[1].Name != "channel-0" || *devs[1].Attributes[AttrID].IntValue != 0 || *devs[130].Attributes[AttrID].IntValue != 129 ||
		*devs[130].Attributes[AttrType].StringValue != TypeChannel {
		t.Fatalf("devices: %d, first %+v", len(devs), devs[:2])
	}

	cases := []struct {
		fault  sim.FabricFault
		effect resourceapi.DeviceTaintEffect
	}{
		{sim.FabricFault{RouteUnhealthy: true}, resourceapi.DeviceTaintEffectNoExecute},
		{sim.FabricFault{DegradedBandwidth: true}, resourceapi.DeviceTaintEffectNoSchedule},
		{sim.FabricFault{State: nvml.GPU_FABRIC_STATE_IN_PROGRESS}, resourceapi.DeviceTaintEffectNoExecute},
		{sim.FabricFault{Status: nvml.ERROR_NOT_READY}, resourceapi.DeviceTaintEffectNoExecute},
	}
	domains := &fakeDomains{}
	domains.put(domain("cd-1", "team", "job", cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7}))
	for _, c := range cases {
		if err := n.SetFabricFault(2, c.fault); err != nil {
			t.Fatal(err)
		}
		td := newTestDriver(t, root, t.TempDir(), t.TempDir(), inventoryOf(t, n), fake.NewClientset(), domains)
		st := td.Status()
		if len(st.Faults) != 1 || st.Faults[0].Key != TaintFabric || st.Faults[0].Effect != c.effect || !strings.Contains(st.Faults[0].Why, "GPU 2") {
			t.Errorf("%+v: faults %+v, want one %s naming GPU 2", c.fault, st.Faults, c.effect)
		}
		devs := Resources("node-a", td.pool, 1, Dropped{}).Pools["node-a"].Slices[0].Devices
		if len(devs[0].Taints) != 0 || len(devs[1].Taints) != 1 || devs[1].Taints[0].Effect != c.effect {
			t.Errorf("%+v: daemon taints %v, channel taints %v", c.fault, devs[0].Taints, devs[1].Taints)
		}
		if noTaints := Resources("node-a", td.pool, 1, Dropped{Taints: true}).Pools["node-a"].Slices[0].Devices; len(noTaints) != 1 {
			t.Errorf("%+v: an API server without taints is offered %d devices, want only the daemon", c.fault, len(noTaints))
		}
		td.daemons.setReady("cd-1")
		res := prepare(t, td.Driver, channelClaim("u", "team", "node-a", "channel-0", "cd-1", ""))
		if refused := res.Err != nil; refused != (c.effect == resourceapi.DeviceTaintEffectNoExecute) {
			t.Errorf("%+v: Prepare %+v", c.fault, res)
		}
	}
	if err := n.SetFabricFault(2, sim.FabricFault{}); err != nil {
		t.Fatal(err)
	}
	if f := FabricOf(inventoryOf(t, n)); len(f.Faults) != 0 {
		t.Errorf("faults after clearing: %+v", f.Faults)
	}
}

// The driver as the kubelet sees it: registered on its own sockets,
// ResourceSlices of compute-domain.nvidia.com written through the API,
// NodePrepareResources answered with the claim's CDI device and its share
// of the channel device.
func TestDriverServesKubelet(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n, root := simTray(t, 4)
	domains := &fakeDomains{}
	domains.put(domain("cd-1", "team", "job", cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7}))
	claim := channelClaim("uid-1", "team", "node-a", "channel-0", "cd-1", "")
	const shareID = "0b5e7d2c-3f41-4a8e-9c6d-1e2f3a4b5c6d"
	claim.Status.Allocation.Devices.Results[0].ShareID = ptrUID(shareID)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: "node-a-uid"}}, claim)
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "registry"), 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := cdi.NewWriter(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	daemons := &fakeDaemons{}
	daemons.setReady("cd-1")
	d, err := New(Options{NodeName: "node-a", Client: client, Domains: domains, Daemons: daemons, StateDir: t.TempDir(), CDI: w, HostRoot: root,
		PluginDir: filepath.Join(dir, "plugin"), RegistryDir: filepath.Join(dir, "registry")})
	if err != nil {
		t.Fatal(err)
	}
	d.SetInventory(inventoryOf(t, n))
	sw, err := client.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Stop()
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	if _, err := os.Stat(filepath.Join(dir, "registry", DriverName+"-reg.sock")); err != nil {
		t.Errorf("no registration socket: %v", err)
	}
	slice := nextSlice(t, sw)
	if slice.Spec.Driver != DriverName || slice.Spec.Pool.Name != "node-a" || len(slice.Spec.Devices) != 5 {
		t.Fatalf("ResourceSlice %+v", slice.Spec)
	}
	// A fabric fault reaches the slice as a taint on the channels.
	if err := n.SetFabricFault(0, sim.FabricFault{RouteUnhealthy: true}); err != nil {
		t.Fatal(err)
	}
	d.SetInventory(inventoryOf(t, n))
	for s := nextSlice(t, sw); len(s.Spec.Devices[1].Taints) == 0; s = nextSlice(t, sw) {
	}
	if err := n.SetFabricFault(0, sim.FabricFault{}); err != nil {
		t.Fatal(err)
	}
	d.SetInventory(inventoryOf(t, n))

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "plugin", "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	kubelet := drapb.NewDRAPluginClient(conn)
	resp, err := kubelet.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "team", Name: claim.Name, Uid: "uid-1"}}})
	if err != nil {
		t.Fatal(err)
	}
	got := resp.Claims["uid-1"]
	if got.GetError() != "" || len(got.GetDevices()) != 1 || got.Devices[0].DeviceName != "channel-0" || got.Devices[0].GetShareId() != shareID ||
		!slices.Equal(got.Devices[0].CdiDeviceIds, []string{cdi.IMEXDeviceName("uid-1")}) {
		t.Fatalf("NodePrepareResources: %+v", got)
	}
	un, err := kubelet.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "team", Name: claim.Name, Uid: "uid-1"}}})
	if err != nil || un.Claims["uid-1"].GetError() != "" {
		t.Fatalf("NodeUnprepareResources: %+v %v", un, err)
	}
}

func nextSlice(t *testing.T, w watch.Interface) *resourceapi.ResourceSlice {
	t.Helper()
	// The deadline only bounds a broken test; the slice is written at once.
	timeout := time.After(30 * time.Second)
	for {
		select {
		case ev := <-w.ResultChan():
			if s, ok := ev.Object.(*resourceapi.ResourceSlice); ok && (ev.Type == watch.Added || ev.Type == watch.Modified) {
				return s
			}
		case <-timeout:
			t.Fatal("no ResourceSlice written")
			return nil
		}
	}
}
