package dra

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
)

// inventory is a simulated node's inventory.
func inventory(t *testing.T, profile string, opts ...sim.Option) *gpu.Inventory {
	t.Helper()
	_, inv := simtest.NodeInventory(t, profile, opts...)
	return inv
}

// fakeClaims records what the driver asks and answers from a table.
type fakeClaims struct {
	mu       sync.Mutex
	prepared []Claim
	answer   map[types.UID]Prepared
	released []ClaimRef
}

func (f *fakeClaims) PrepareClaims(_ context.Context, claims []Claim) (map[types.UID]Prepared, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.prepared = append(f.prepared, claims...)
	return f.answer, nil
}

func (f *fakeClaims) UnprepareClaims(_ context.Context, claims []ClaimRef) (map[types.UID]error, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.released = append(f.released, claims...)
	out := map[types.UID]error{}
	for _, c := range claims {
		out[c.UID] = nil
	}
	return out, nil
}

func allocatedClaim(uid, name string, results ...resourceapi.DeviceRequestAllocationResult) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: results},
		}},
	}
}

// The driver as the kubelet and the API server see it: registered on its
// sockets, ResourceSlices written through the API, NodePrepareResources
// answered from the loop's decisions.
func TestDriverServesKubelet(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	mine := resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-1"}
	other := resourceapi.DeviceRequestAllocationResult{Request: "nic", Driver: "net.example.com", Pool: "node-a", Device: "eth0"}
	elsewhere := resourceapi.DeviceRequestAllocationResult{Request: "gpu2", Driver: devicemodel.DriverName, Pool: "node-b", Device: "gpu-0"}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: "node-a-uid"}}
	client := fake.NewClientset(node, allocatedClaim("uid-a", "a", mine, other, elsewhere))
	claims := &fakeClaims{answer: map[types.UID]Prepared{"uid-a": {Devices: []PreparedDevice{
		{Requests: []string{"gpu"}, Device: "gpu-1", CDIDevices: []string{"nvidia.com/gpu=GPU-1"}},
	}}}}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "registry"), 0o755); err != nil {
		t.Fatal(err)
	}
	d := New(Options{NodeName: "node-a", Client: client, PluginDir: filepath.Join(dir, "plugin"), RegistryDir: filepath.Join(dir, "registry"),
		HealthResend: time.Hour}) // no resend during the test: each report is a change
	inv := inventory(t, "pcie-4gpu")
	d.Publish(&devicemodel.Pool{Devices: devicemodel.Devices(inv, nil, map[string]string{inv.GPUs[3].UUID: "XID 48"})})
	d.SetClaims(claims)
	w, err := client.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer d.Stop()

	// The pool published before Start reaches the API.
	slice := nextSlice(t, w)
	if slice.Spec.Driver != devicemodel.DriverName || slice.Spec.Pool.Name != "node-a" || slice.Spec.NodeName == nil || *slice.Spec.NodeName != "node-a" || len(slice.Spec.Devices) != 4 {
		t.Fatalf("ResourceSlice %+v", slice.Spec)
	}
	if i := slices.IndexFunc(slice.Spec.Devices, func(d resourceapi.Device) bool { return len(d.Taints) > 0 }); i != 3 {
		t.Errorf("tainted device at %d, want gpu-3", i)
	}

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "plugin", "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	kubelet := drapb.NewDRAPluginClient(conn)
	resp, err := kubelet.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "default", Name: "a", Uid: "uid-a"}}})
	if err != nil {
		t.Fatal(err)
	}
	got := resp.Claims["uid-a"]
	if got.GetError() != "" || len(got.GetDevices()) != 1 || got.Devices[0].DeviceName != "gpu-1" || got.Devices[0].PoolName != "node-a" ||
		!slices.Equal(got.Devices[0].CdiDeviceIds, []string{"nvidia.com/gpu=GPU-1"}) {
		t.Errorf("NodePrepareResources: %+v", got)
	}
	claims.mu.Lock()
	if len(claims.prepared) != 1 || !slices.Equal(claims.prepared[0].Devices, []Allocated{{Request: "gpu", Device: "gpu-1"}}) {
		t.Errorf("the loop was asked %+v; want only this driver's results in this node's pool", claims.prepared)
	}
	claims.mu.Unlock()

	// A refusal reaches the kubelet with its reason.
	claims.mu.Lock()
	claims.answer = map[types.UID]Prepared{"uid-a": {Err: fmt.Errorf("device gpu-1 is in use by ml/trainer (device plugin)")}}
	claims.mu.Unlock()
	resp, err = kubelet.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "default", Name: "a", Uid: "uid-a"}}})
	if err != nil {
		t.Fatal(err)
	}
	if e := resp.Claims["uid-a"].GetError(); !strings.Contains(e, "ml/trainer") {
		t.Errorf("refusal reached the kubelet as %q", e)
	}

	un, err := kubelet.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "default", Name: "a", Uid: "uid-a"}}})
	if err != nil || un.Claims["uid-a"].GetError() != "" {
		t.Fatalf("NodeUnprepareResources: %+v, %v", un, err)
	}

	// The kubelet's health stream: the whole pool at once, then each change.
	health, err := drahealth.NewDRAResourceHealthClient(conn).NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := health.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got := healthOf(first); len(got) != 4 || got["gpu-0"] != "HEALTHY" || got["gpu-3"] != "UNHEALTHY: XID 48" {
		t.Errorf("first health report %v", got)
	}

	// A new pool (GPU 3 recovered) replaces the slice's devices and is streamed.
	d.Publish(&devicemodel.Pool{Devices: devicemodel.Devices(inv, nil, nil)})
	next, err := health.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got := healthOf(next); len(got) != 4 || got["gpu-3"] != "HEALTHY" {
		t.Errorf("health after recovery %v", got)
	}
	for {
		s := nextSlice(t, w)
		if !slices.ContainsFunc(s.Spec.Devices, func(d resourceapi.Device) bool { return len(d.Taints) > 0 }) {
			break
		}
	}
}

func healthOf(r *drahealth.NodeWatchResourcesResponse) map[string]string {
	out := map[string]string{}
	for _, d := range r.Devices {
		v := d.Health.String()
		if d.Message != "" {
			v += ": " + d.Message
		}
		if d.Device.PoolName != "node-a" || d.LastUpdatedTime == 0 || d.HealthCheckTimeoutSeconds != 3*3600 {
			v += fmt.Sprintf(" (pool %q, updated %d, timeout %d)", d.Device.PoolName, d.LastUpdatedTime, d.HealthCheckTimeoutSeconds)
		}
		out[d.Device.DeviceName] = v
	}
	return out
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

// ClaimOf keeps this driver's results in this node's pool, with the share and
// the capacity a shared device's claim consumes, and which of the driver's
// taints each request tolerates (the cordon's is NoSchedule only, so a
// toleration of NoExecute alone does not cover it).
func TestClaimOf(t *testing.T) {
	share := types.UID("share-1")
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{UID: "uid-1", Namespace: "ns", Name: "c"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-1", ShareID: &share,
					ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{devicemodel.CapacityShares: resource.MustParse("2"), "memory": resource.MustParse("10Gi")}},
				{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node-b", Device: "gpu-1"},
				{Request: "nic", Driver: "other.example.com", Pool: "node-a", Device: "nic-0"},
				{Request: "watch", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-2", AdminAccess: ptr.To(true),
					Tolerations: []resourceapi.DeviceToleration{{Key: devicemodel.TaintUnhealthy, Operator: resourceapi.DeviceTolerationOpExists}}},
				{Request: "any", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-3", AdminAccess: ptr.To(false),
					Tolerations: []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoExecute}}},
				{Request: "other", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-4",
					Tolerations: []resourceapi.DeviceToleration{{Key: "example.com/other", Operator: resourceapi.DeviceTolerationOpExists}}},
				{Request: "cordon", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-5",
					Tolerations: []resourceapi.DeviceToleration{{Key: devicemodel.TaintCordoned, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}}},
				{Request: "all", Driver: devicemodel.DriverName, Pool: "node-a", Device: "gpu-6",
					Tolerations: []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}},
			},
		}}},
	}
	got := ClaimOf(c, "node-a")
	want := []Allocated{
		{Request: "gpu", Device: "gpu-1", ShareID: share, SharesTaken: 2, MemoryBytes: 10 << 30},
		{Request: "watch", Device: "gpu-2", AdminAccess: true, ToleratesUnhealthy: true},
		{Request: "any", Device: "gpu-3", ToleratesUnhealthy: true},
		{Request: "other", Device: "gpu-4"},
		{Request: "cordon", Device: "gpu-5", ToleratesCordon: true},
		{Request: "all", Device: "gpu-6", ToleratesUnhealthy: true, ToleratesCordon: true},
	}
	if got.UID != "uid-1" || !slices.Equal(got.Devices, want) {
		t.Errorf("ClaimOf: %+v, want devices %+v", got, want)
	}
}

// The kubelet's health stream says a cordoned device is unhealthy, and why.
func TestHealthStreamCordoned(t *testing.T) {
	pool := &devicemodel.Pool{Devices: []devicemodel.Device{{Name: "gpu-0", Type: devicemodel.TypeGPU, UUID: "GPU-0"},
		{Name: "gpu-1", Type: devicemodel.TypeGPU, UUID: "GPU-1", Index: 1, Cordoned: "cordoned"}}}
	d := New(Options{NodeName: "node-a", Now: time.Now})
	d.Publish(pool)
	for _, h := range d.healthResponse().Devices {
		if cordoned := h.Device.DeviceName == "gpu-1"; cordoned != (h.Health == drahealth.HealthStatus_UNHEALTHY && h.Message == "cordoned") {
			t.Errorf("health stream: %s %v %q", h.Device.DeviceName, h.Health, h.Message)
		}
	}
}

// A claim's allocation carries its configs to Prepare.
func TestClaimOfConfigs(t *testing.T) {
	c := &resourceapi.ResourceClaim{Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node", Device: "gpu-0"}},
			Config: []resourceapi.DeviceAllocationConfiguration{
				opaque(resourceapi.AllocationConfigSourceClaim, devicemodel.DriverName, `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`),
			},
		},
	}}}
	got := ClaimOf(c, "node")
	if len(got.Configs) != 1 || got.Configs[0].Sharing == nil || got.Configs[0].Sharing.Strategy != devicemodel.StrategyMPS {
		t.Fatalf("configs %+v, want the claim's MPS config", got.Configs)
	}
}

func opaque(source resourceapi.AllocationConfigSource, driver, raw string, requests ...string) resourceapi.DeviceAllocationConfiguration {
	return resourceapi.DeviceAllocationConfiguration{
		Source: source, Requests: requests,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(raw)},
		}},
	}
}
