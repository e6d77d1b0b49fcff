package dra

import (
	"context"
	"time"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// sliceController is what publishing needs of resourceslice.Controller.
type sliceController interface {
	Update(*resourceslice.DriverResources)
	Stop()
}

// startSlices starts the ResourceSlice controller of
// k8s.io/dynamic-resource-allocation with res, the slices owned by this
// node's Node (whose UID it reads once). It returns once the controller's
// informer has synced with the API server, or ctx ends.
func (d *Driver) startSlices(ctx context.Context, res resourceslice.DriverResources) (sliceController, error) {
	return resourceslice.StartController(ctx, resourceslice.Options{
		DriverName:   devicemodel.DriverName,
		KubeClient:   d.opts.Client,
		Owner:        &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: d.opts.NodeName},
		Resources:    &res,
		ErrorHandler: d.HandleError,
	})
}

// startPublishing runs publishing (runPublishing) and the checks of the API
// server's copy (checkLoop) in the background until Stop.
func (d *Driver) startPublishing(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	d.mu.Lock()
	d.stopPublishing = cancel
	d.mu.Unlock()
	d.running.Add(1)
	go func() {
		defer d.running.Done()
		d.runPublishing(ctx)
	}()
	if d.opts.SliceCheck > 0 {
		d.running.Add(1)
		go func() {
			defer d.running.Done()
			d.checkLoop(ctx)
		}()
	}
}

// runPublishing hands a ResourceSlice controller the first pool, and every
// later one from then on. Starting a controller waits for its informer to
// sync with the API server: a second at best (it polls), and for as long
// as the API server cannot be reached. Neither the agent's loop (Publish)
// nor the kubelet's calls may wait on that, so it runs here, without the
// lock.
//
// The controller sees the API server only through its watch, which is
// blind to data the API server lost (etcd restored from a backup, or
// wiped): it goes on updating slices that are gone, and owns new ones by
// the UID of a Node since recreated. When CheckSlices finds the API
// server's copy stays not ours, publishing starts over here with a new
// controller, which lists the API server and reads the Node afresh.
func (d *Driver) runPublishing(ctx context.Context) {
	for {
		d.mu.Lock()
		for d.pool == nil {
			d.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-d.poolSet:
			}
			d.mu.Lock()
		}
		res := d.nextLocked() // a Publish or HandleError from now on makes it stale again
		d.slices.WaitingForAPI = d.opts.Now()
		d.mu.Unlock()
		d.log.Info("DRA: starting ResourceSlice publishing; it waits for the API server")
		ctrl, err := d.startController(ctx, res)
		if err != nil {
			// Only the end of ctx: nothing to retry.
			if ctx.Err() != nil {
				d.log.Info("DRA: stopped before the API server took the ResourceSlices", "err", err)
			} else {
				d.log.Error("DRA: cannot publish ResourceSlices", "err", err)
			}
			return
		}
		d.mu.Lock()
		d.tookLocked(res)
		d.slices.WaitingForAPI = time.Time{}
		d.controller = ctrl
		d.publishLocked() // what changed while it waited
		d.mu.Unlock()

		var foreign []resourceapi.ResourceSlice
		select {
		case <-ctx.Done():
			ctrl.Stop()
			return
		case foreign = <-d.restart:
		}
		d.mu.Lock()
		d.controller = nil
		d.stale = true
		d.mu.Unlock()
		// Stop waits for the controller's worker, which may be in
		// HandleError, which takes the lock.
		ctrl.Stop()
		d.deleteForeign(ctx, foreign)
		d.log.Warn("DRA: the API server's ResourceSlices are not the ones published; publishing starts over")
	}
}

// deleteForeign deletes this node's slices owned by another Node: a new
// controller would update them in place, keeping the owner, and the
// garbage collector deletes them once it sees that owner gone.
func (d *Driver) deleteForeign(ctx context.Context, slices []resourceapi.ResourceSlice) {
	for _, s := range slices {
		err := d.opts.Client.ResourceV1().ResourceSlices().Delete(ctx, s.Name,
			metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &s.UID}})
		if err != nil && !apierrors.IsNotFound(err) {
			d.log.Error("DRA: delete ResourceSlice "+s.Name+" owned by a Node that is gone", "err", err)
		}
	}
}

// publishLocked hands the controller the pool as it is now, if it
// changed; that only queues the update.
func (d *Driver) publishLocked() {
	if d.controller == nil || d.pool == nil || !d.stale {
		return
	}
	res := d.nextLocked()
	d.controller.Update(&res)
	d.tookLocked(res)
}

// nextLocked is the pool, as it is now, for the controller: the next
// generation, and no longer stale.
func (d *Driver) nextLocked() resourceslice.DriverResources {
	d.gen++
	d.stale = false
	return devicemodel.Resources(d.opts.NodeName, d.pool, d.gen, d.dropped)
}

// tookLocked records that the controller took res.
func (d *Driver) tookLocked(res resourceslice.DriverResources) {
	pool := res.Pools[d.opts.NodeName]
	d.handed = pool
	d.slices.Generation, d.slices.At = pool.Generation, d.opts.Now()
	devices, sets := 0, 0
	for _, s := range pool.Slices {
		devices, sets = devices+len(s.Devices), sets+len(s.SharedCounters)
	}
	d.log.Info("DRA: ResourceSlices updated", "devices", devices, "counterSets", sets,
		"slices", len(pool.Slices), "generation", pool.Generation)
}
