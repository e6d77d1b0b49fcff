package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// withPodResources dials the kubelet's pod-resources socket for one call.
func (e *Env) withPodResources(ctx context.Context, f func(podresourcesv1.PodResourcesListerClient) error) error {
	conn, err := grpc.NewClient("unix://"+e.d.podResources, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("pod-resources %s: %w", e.d.podResources, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := f(podresourcesv1.NewPodResourcesListerClient(conn)); err != nil {
		return fmt.Errorf("pod-resources %s: %w", e.d.podResources, err)
	}
	return nil
}

// Allocatable returns GetAllocatableResources as resource name → sorted device IDs. The kubelet lists only
// healthy devices of plugins it has heard from, so this is what a new pod can be given.
func (e *Env) Allocatable(ctx context.Context) (map[string][]string, error) {
	out := map[string][]string{}
	err := e.withPodResources(ctx, func(c podresourcesv1.PodResourcesListerClient) error {
		resp, err := c.GetAllocatableResources(ctx, &podresourcesv1.AllocatableResourcesRequest{})
		if err != nil {
			return err
		}
		for _, d := range resp.GetDevices() {
			out[d.GetResourceName()] = append(out[d.GetResourceName()], d.GetDeviceIds()...)
		}
		return nil
	})
	for _, ids := range out {
		slices.Sort(ids)
	}
	return out, err
}

// WaitAllocatable waits until the kubelet offers exactly n devices of resource and returns their IDs.
func (e *Env) WaitAllocatable(ctx context.Context, resource string, n int) ([]string, error) {
	var ids []string
	err := poll(ctx, 200*time.Millisecond, func() error {
		if e.kubelet != nil {
			if done, werr := e.kubelet.Exited(); done {
				return stop(fmt.Errorf("kubelet exited: %v", werr))
			}
		}
		all, err := e.Allocatable(ctx)
		if err != nil {
			return err
		}
		ids = all[resource]
		if len(ids) != n {
			return fmt.Errorf("kubelet offers %d %s devices, want %d (all: %v)", len(ids), resource, n, all)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("allocatable %s: %w", resource, err)
	}
	return ids, nil
}

// PodDevices returns, from pod-resources List, the device IDs of resource that the kubelet assigned to the
// static pod's container.
func (e *Env) PodDevices(ctx context.Context, name, resource string) ([]string, error) {
	return e.podDevices(ctx, PodNamespace, e.PodName(name), resource)
}

// podDevices returns, from pod-resources List, the device IDs of resource that the kubelet assigned to the
// containers of pod namespace/full.
func (e *Env) podDevices(ctx context.Context, namespace, full, resource string) ([]string, error) {
	var ids []string
	found := false
	err := e.withPodResources(ctx, func(c podresourcesv1.PodResourcesListerClient) error {
		resp, err := c.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
		if err != nil {
			return err
		}
		for _, p := range resp.GetPodResources() {
			if p.GetName() != full || p.GetNamespace() != namespace {
				continue
			}
			found = true
			for _, c := range p.GetContainers() {
				for _, d := range c.GetDevices() {
					if d.GetResourceName() == resource {
						ids = append(ids, d.GetDeviceIds()...)
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, fmt.Errorf("pod-resources List: pod %s/%s not listed", namespace, full)
	}
	slices.Sort(ids)
	return ids, nil
}

// Checkpoint is the part of the kubelet's device manager checkpoint the suite reads.
type Checkpoint struct {
	// RegisteredDevices: resource → device IDs the kubelet counts as healthy.
	RegisteredDevices map[string][]string
	// PodDevices: (pod UID, container, resource) → device IDs, i.e. the allocations that survive restarts.
	PodDevices []CheckpointEntry
}

// CheckpointEntry is one allocation in the checkpoint.
type CheckpointEntry struct {
	PodUID        string
	ContainerName string
	ResourceName  string
	DeviceIDs     map[int64][]string // NUMA node → IDs
}

// ReadCheckpoint reads kubelet_internal_checkpoint from the device plugin directory.
func ReadCheckpoint() (*Checkpoint, error) {
	p := filepath.Join(DevicePluginDir, "kubelet_internal_checkpoint")
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	return parseCheckpoint(b)
}

func parseCheckpoint(b []byte) (*Checkpoint, error) {
	var raw struct {
		Data struct {
			PodDeviceEntries  []CheckpointEntry
			RegisteredDevices map[string][]string
		}
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("device manager checkpoint: %w", err)
	}
	return &Checkpoint{RegisteredDevices: raw.Data.RegisteredDevices, PodDevices: raw.Data.PodDeviceEntries}, nil
}

// DynamicResources lists, from pod-resources List, each container's devices held through DRA claims as
// "namespace/pod/container: claim namespace/name driver/pool/device", sorted.
func (e *Env) DynamicResources(ctx context.Context) ([]string, error) {
	var out []string
	err := e.withPodResources(ctx, func(c podresourcesv1.PodResourcesListerClient) error {
		resp, err := c.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
		if err != nil {
			return err
		}
		for _, p := range resp.GetPodResources() {
			for _, ctr := range p.GetContainers() {
				for _, dr := range ctr.GetDynamicResources() {
					for _, r := range dr.GetClaimResources() {
						out = append(out, fmt.Sprintf("%s/%s/%s: %s/%s %s/%s/%s", p.GetNamespace(), p.GetName(), ctr.GetName(),
							dr.GetClaimNamespace(), dr.GetClaimName(), r.GetDriverName(), r.GetPoolName(), r.GetDeviceName()))
					}
				}
			}
		}
		return nil
	})
	slices.Sort(out)
	return out, err
}
